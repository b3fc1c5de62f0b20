// Package integration holds the end-to-end, replay and fault-injection tests
// that run onceler against real RabbitMQ, PostgreSQL and Python Celery.
//
// TestMain builds the onceler binary and integration/testdata/replayworker
// (a worker binary "of your own": the demo tasks plus replay.notify, policy
// retry, replay.audit, policy skip, and replay.slow) once per run; the tests
// start, stop, kill -9 and SIGSTOP them as separate processes, each test on
// its own queue, record schema and worker names (package replay).
//
// # Replay suite (main test step)
//
//   - TestReplayDemo: every scenario of package replay for every demo task
//     (demo.ledger.credit, demo.payments.charge, demo.email.send,
//     demo.sleep; demo.add, demo.flaky and demo.fail have no effects to
//     count, so only their results, records and queue are checked), with
//     the record (the guarantee must hold) and with --no-record (the
//     duplicate must show).
//   - TestReplayDemoRedis: the same with the workers' results in Redis
//     (--result-backend redis://, database 9): every caller's result is
//     read from its celery-task-meta-<id> key.
//   - TestChordsRedisKill: real Celery chords of demo.add parts and a
//     demo.xsum body over two workers, one killed before its ack or when
//     it completed a chord (crash point chord_joined): each body published
//     once, with its sum.
//   - TestReplaySkipPolicy: the same for replay.audit (policy skip); the
//     replay package's TestOwnBinary does it for replay.notify (retry).
//   - TestPythonProducerDuplicates: real Python Celery (testdata/producer.py)
//     sends the duplicates and reads the results with its rpc backend.
//
// # Fault injection on the test's own processes (main test step)
//
//   - TestKillMidTaskFullPrefetch: kill -9 with tasks running and the
//     prefetch window full; every message comes back, none lost, none done
//     twice.
//   - TestStopPastLeaseSameDB, TestStopPastLeaseOutside: SIGSTOP past the
//     lease (and the broker heartbeat), a second worker takes over, SIGCONT:
//     the old owner's late completion is refused (the record stays the
//     second worker's) and its ack went with its channel; one effect for
//     same-database tasks, at most two for policy retry. (Token fencing
//     while the new owner still holds the claim is proven in package
//     idempotency.)
//   - TestPoisonAlwaysFails, TestPoisonCrashLoop: a task that always fails
//     is answered FAILURE after a bounded number of attempts; one that kills
//     its worker every time is quarantined as poison after the bounded
//     number of claims.
//   - TestDuplicateIDDifferentArguments: one task id, one operation key, two
//     argument sets at once: one runs, the other is a fingerprint mismatch
//     (FAILURE to its caller, quarantined), no second effect.
//   - TestTerminateWorkerBackends: pg_terminate_backend of the workers'
//     connections (their application_name) mid-stream.
//   - TestBrokerResetWorkerConnections: the broker closes the workers'
//     connections mid-stream.
//   - TestSIGTERMDuringTasks: SIGTERM to an onceler worker with tasks
//     running: within the grace period they finish and are answered by it;
//     past it they are cut (no effect, no answer), redelivered and completed
//     once by a second worker process.
//   - TestTwoWorkerProcessesDuplicates: two onceler workers, 2,000 messages
//     for 500 operations (4 callers each, interleaved and back to back):
//     500 effects, 2,000 results, onceler repeats --json shows 1,500
//     duplicates.
//   - TestBlackhole: a TCP proxy between the workers and PostgreSQL or
//     RabbitMQ stops passing bytes: dead connections are detected, nothing
//     is lost.
//
// # Faults on services, and the soak (serial step, ONCELER_FAULT_TESTS=1)
//
// These restart or disconnect a RabbitMQ node or PostgreSQL server of their
// own (started in a temporary directory), so nobody else's tests are
// disturbed; they take minutes, so CI runs them after the main step, one
// package at a time: go test -p 1 -run 'Fault|Soak'.
//
//   - TestFaultBrokerCloseAllConnections: rabbitmqctl close_all_connections
//     in the middle of 1,000 operations.
//   - TestFaultBrokerRestart: rabbitmqctl stop_app, start_app.
//   - TestFaultPostgresRestart: pg_ctl restart -m fast and -m immediate,
//     each in the middle of 1,000 operations.
//   - TestFaultClusterNodeStopped, TestFaultClusterNodeKilled: a 3-node
//     RabbitMQ cluster of their own (rabbitCluster), a quorum work queue,
//     two workers with the cluster's URL list; the node of one worker,
//     which leads the queue, is stopped (stop_app) or its VM killed
//     (kill -9), then started again, in the middle of 5,000 same-database
//     and 5,000 lookup operations; they print a table of what they found.
//   - TestFaultClusterDeliveryLimit: a quorum queue with x-delivery-limit
//     and a task that kills its worker each time: quarantined as poison on
//     the broker's last delivery, its caller answered.
//   - TestFaultConsumerTimeout: tasks longer than RabbitMQ's
//     consumer_timeout (5 s): the broker closes the worker's channel; each
//     effect once, each caller one result, one warning naming the setting.
//   - TestFaultMemoryAlarm: a 40 s memory alarm (set_vm_memory_high_watermark)
//     over plain tasks, a retry and a chain: nothing answered or
//     acknowledged while it holds, everything answered once after it.
//   - TestFaultPostgresFailover: a primary and a synchronous standby
//     (pg_basebackup -R, synchronous_standby_names), workers with a
//     two-host URL (target_session_attrs=read-write); the primary stopped
//     -m immediate in the middle of 1,000 operations and the standby
//     promoted: the workers follow without a restart, nothing lost or done
//     twice; prints how long the workers took to resume.
//   - TestFaultPostgresFailoverPartitioned, TestFaultPostgresAsyncFailover:
//     the standby cut off (its replication connection black-holed), more
//     operations sent, the primary crashed, the standby promoted:
//     synchronous, nothing answered during the cut and nothing lost;
//     asynchronous, the completions answered during the cut are lost
//     (same-database effects gone, outside ones repeated when called again,
//     stale claims): the cost, counted every run.
//   - TestFaultPostgresOutage: PostgreSQL stopped for two minutes under a
//     backlog of 5,000 operations: nothing acknowledged or answered,
//     /readyz 503, then everything drains once.
//   - TestSoak: 20,000 calls (ONCELER_SOAK_TASKS) of every mode, a fifth of
//     them duplicates, through 3 workers, kill -9 of a random worker every
//     few seconds, a reset of the workers' broker connections and a
//     PostgreSQL restart; it prints a table of what it did and found.
package integration
