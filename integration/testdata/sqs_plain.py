"""A plain SQS producer (boto3), for the SQS tests.

argv[1] is a JSON object: endpoint (the SQS server), queue (its name), and
messages: a list of {body, attributes} (body a string, attributes a mapping
of names to string values), sent in order. Prints the message ids as JSON.
"""
import json
import sys

import boto3

spec = json.loads(sys.argv[1])
sqs = boto3.client("sqs", endpoint_url=spec["endpoint"], region_name="us-east-1",
                   aws_access_key_id="onceler-test", aws_secret_access_key="onceler-test")
url = sqs.get_queue_url(QueueName=spec["queue"])["QueueUrl"]
ids = []
for m in spec["messages"]:
    kw = {"QueueUrl": url, "MessageBody": m["body"]}
    attrs = m.get("attributes") or {}
    if attrs:
        kw["MessageAttributes"] = {k: {"DataType": "String", "StringValue": v} for k, v in attrs.items()}
    if spec["queue"].endswith(".fifo"):
        kw["MessageGroupId"] = m.get("group", "default")
        kw["MessageDeduplicationId"] = m.get("dedup") or str(len(ids)) + "-" + str(id(m))
    ids.append(sqs.send_message(**kw)["MessageId"])
print(json.dumps(ids))
