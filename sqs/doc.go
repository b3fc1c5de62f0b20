// Package sqs consumes Amazon SQS queues for the onceler worker: a Client
// receives messages by long polling in batches of up to ten, extends their
// visibility while their tasks run (ChangeMessageVisibility, batched where
// the server has ChangeMessageVisibilityBatch), deletes them in batches
// once they are answered, hands them back (visibility 0) and sends copies:
// to the queue again (a retry, an ETA), to the next task's queue (a chain)
// or to the quarantine queue, with the reason as message attributes.
//
// The endpoint, region and credentials come from the AWS SDK's standard
// configuration (AWS_REGION, AWS_ACCESS_KEY_ID, AWS_PROFILE, the shared
// config and credentials files, ...); Config.Endpoint overrides the
// endpoint for a local server. The client speaks SQS's query protocol,
// which every SQS endpoint and the local servers used in tests (goaws)
// answer.
//
// Two kinds of messages come on a queue. A Celery message as kombu's SQS
// transport writes it (Celery's broker_url "sqs://"): a JSON envelope of the
// message's body, headers and properties, base64-encoded as a whole
// (DecodeKombu, EncodeKombu). A plain message from any producer: its body
// is the task's arguments as JSON, its task named by the message attribute
// "task" (or the queue's task, Queue.Task) and its idempotency key by the
// attribute "idempotency_key".
package sqs
