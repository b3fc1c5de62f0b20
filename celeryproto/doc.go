// Package celeryproto reads and writes the Celery wire protocol: task messages
// (protocol 1 and 2), their serializers and compression, rpc backend results,
// and the payloads of events and remote-control replies. It is pure: bytes
// and headers in, typed values out, with no network access and no AMQP
// client import. It follows what Celery 5.2.6 / kombu 5.2.4 really send; the
// tests decode golden vectors captured from them (testdata/gen.py) and have
// real Celery decode what this package encodes.
//
// # Decoding
//
// [Decode] (or a [Decoder] from [NewDecoder] with its own [Limits]) turns a
// [Delivery] (properties, headers as an AMQP client hands them over, body)
// into one [Message], whatever the protocol:
//
//   - protocol 2: the "task" header is present; headers carry the task
//     fields, the body is [args, kwargs, embed];
//   - protocol 1: no "task" header; the body is a mapping with task, id,
//     args, kwargs, eta, expires, timelimit, callbacks, errbacks, chord;
//   - hybrid: a "task" header with a protocol 1 style body (a mapping with
//     "args"): the body is read, then the headers override it, as Celery's
//     worker does.
//
// Header values may be any AMQP table type: integers of every width,
// floats, nil, []any, map[string]any, time.Time, []byte. Time limits are
// read in Celery's real order [hard, soft]. Headers the protocol does not
// define (for example "idempotency_key") are kept in [Message.Headers].
// Argument values come out as nil, bool, int64, float64, string, []byte,
// time.Time, []any and map[string]any; JSON integers are exact int64 (an
// integer beyond the int64 range becomes float64).
//
// Times: [ParseTime] reads every form Celery sends (with or without a
// fraction, "Z", an offset or none: naive means UTC). [FormatTime] writes
// what Celery 5.2 parses: UTC, 6 fraction digits, "+00:00". An eta or
// expires given as a time value outside what Celery can read is refused
// ([ErrBadHeader]), never read as a time in the past: an AMQP timestamp
// past 9999-12-31 (or past 2^63 s, which amqp091-go reads as a negative
// count), any other time outside the years 1 to 9999.
//
// # Serializers
//
// JSON (application/json), msgpack (application/x-msgpack) and YAML
// (application/x-yaml, safe: plain data only; a tag PyYAML's safe_load
// would refuse, such as !!python/object, is refused, and so is a stream of
// more than one document, as safe_load refuses it). JSON accepts kombu 5.2's plain
// form and kombu >= 5.3's {"__type__": T, "__value__": V} envelopes
// (datetime and date become time.Time; bytes and base64 become []byte;
// uuid, decimal and time become strings), and Python's NaN and Infinity.
// Pickle (application/x-python-serialize) is refused without being looked at
// ([ErrPickle]); any other content type gives [ErrUnsupportedContentType].
//
// # Compression
//
// The "compression" header names how the serialized body is compressed:
// application/x-gzip (aliases gzip, zlib; a zlib stream), application/x-bz2
// (bzip2), application/x-lzma (lzma, xz; an xz container),
// application/x-brotli (brotli) and application/zstd (zstd). The decoded
// size is bounded by [Limits.MaxBodyBytes] (default 16 MiB), so a
// decompression bomb gives [ErrTooLarge] after reading at most that much.
// Memory declared up front by the format is bounded too: an xz body must be
// one stream whose LZMA2 dictionaries are at most 64 MiB, whose index
// declares no more than the limit, and whose blocks end where the index
// says (their LZMA2 chunks are walked by their headers, so that no block
// hides in another); a zstd window is bounded the same way. A YAML body is
// at most 1 MiB once decompressed: its parser needs about a hundred times
// that. The decoded values are bounded too, as they are decoded: each
// element is charged [ElementCost] bytes plus its text against
// [Limits.MaxDecodedBytes] (default 64 MiB), and at most [Limits.MaxElements]
// (default 1 Mi) elements are read, so that a small body of tiny elements
// (a msgpack empty map is one byte) cannot take gigabytes; a declared list
// or map length is checked before it is allocated. [Decoder.Estimate]
// bounds the memory a delivery's decoding takes without decoding it, and
// [Decoder.DecodeCost] returns what the decoded message holds, for a
// caller that budgets memory (see docs/limits.md). Headers the worker
// keeps in the record must be storable text (the
// task name and id: UTF-8 without NUL), and retries must be from 0 to 2^20.
//
// # Encoding
//
// [EncodeTask] writes a [Message] as a task message for retries, chain
// steps, callbacks and errbacks: protocol 2 by default or protocol 1, JSON,
// msgpack or YAML, optionally compressed (every compression but bzip2, for
// which Go has no writer). [EncodeResult] writes a [Result] the way the
// rpc:// backend publishes it: SUCCESS with a value, FAILURE, RETRY and
// REVOKED with an [Exception] ({"exc_type", "exc_message", "exc_module"}),
// which the Python client turns back into that exception class.
// [CanonicalArgs] and [Fingerprint] give a byte form of args and kwargs
// independent of key order and of JSON versus msgpack, for idempotency
// fingerprints. Event and remote-control payloads are in event.go and
// control.go.
//
// # Errors
//
// Every decoding error is a *[DecodeError] that says what was wrong, for
// example
//
//	unsupported content type "application/x-python-serialize": pickle is never decoded
//	protocol 2 body must be a 3-element list, got object
//
// and matches exactly one sentinel with errors.Is: [ErrUnsupportedContentType],
// [ErrPickle], [ErrCompression], [ErrTooLarge], [ErrMalformed], [ErrShape],
// [ErrBadHeader]. None of them can succeed on a retry: the consumer
// quarantines the message with [Reason](err) as the reason. The decoder
// never panics on hostile input (it is fuzzed) and never puts argument
// values in an error.
package celeryproto
