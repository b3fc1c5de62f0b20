// Package sidekiq runs Sidekiq jobs from Go: it speaks the Redis layout of
// Sidekiq 6.4 (Ruby) as a Sidekiq process does, so that Ruby producers
// (Sidekiq::Client, perform_async, perform_in, ActiveJob's :sidekiq
// adapter) enqueue to it unchanged and Sidekiq's API and Web UI show what
// it does: its process, busy jobs, counters, retries and dead jobs.
//
// # Use
//
//	c, err := sidekiq.New(sidekiq.Config{URL: "redis://127.0.0.1:6379/0", Queues: []string{"critical,2", "default"}})
//	...
//	defer c.Close()
//	go c.Run(ctx, func(sig string) { ... })  // heartbeat, scheduler, recovery
//	for {
//		j, err := c.Fetch(ctx)                 // j is in the working list now
//		if j != nil && err != nil { c.Kill(ctx, j, "DecodeError", err.Error()); continue }
//		c.Begin(j)
//		runErr := run(j)
//		c.End(j, runErr != nil)
//		if runErr == nil { c.Done(ctx, j) } else { c.Retry(ctx, j, "MyError", runErr.Error(), nil) }
//	}
//
// Run must run while the client fetches: its heartbeat keeps the client's
// working lists from being taken for a dead process's. Close the client
// after Run has returned.
//
// # Requirements
//
// Redis 6.2 or later (LMOVE), with maxmemory-policy noeviction, as
// Sidekiq requires: an evicted queue, working list or registry loses jobs.
//
// Config.Identity names the process; each live process needs its own. The
// default is unique per run. A fixed identity (a StatefulSet pod's name)
// is fine as long as two live processes never share it: New takes the
// jobs left in the working lists of that identity (by a run that crashed)
// back to their queues, jobs that a live process of the same identity
// would be holding.
//
// # Reliable fetch
//
// Sidekiq's own BasicFetch pops a job (BRPOP) and loses it if the process
// dies before it finishes. Fetch instead moves the job (LMOVE, BLMOVE) to a
// working list of this process, and every way of settling the job removes
// it from there in the same Lua script that puts it where it goes next:
// Done (finished), Requeue (back to the head of its queue, fetched next),
// Retry (retry set or dead set), Kill (dead set), Schedule (schedule set).
// A job is therefore always in exactly one place (or, by Sidekiq's rules,
// dropped: see Retries). Each script checks the types of the keys it
// writes before it removes anything, so a key of the wrong type makes it
// fail with nothing written. When a process's
// heartbeat key expires (HeartbeatTTL, 60 s by default, after the last
// heartbeat), any other Client's Run moves the jobs of its working lists
// back to their queues, oldest first, in one script that first checks that
// the heartbeat is still gone; it also ends the process's epoch. A process
// that stalls longer than HeartbeatTTL and comes back finds its jobs gone:
// settling them returns an error wrapping ErrNotHeld and writes nothing,
// also when the same job was fetched again since (Fetch records the epoch
// in the Job), and the jobs run again elsewhere. Every fetch registers the
// process's working lists in the same script as the move, so a job
// fetched after a recovery is recovered too if the process then dies.
// Delivery is at least once; exactly-once effects are the caller's (an
// idempotency record keyed by Job.IdempotencyKey or JID).
//
// go-redis sends a command again when the connection breaks before the
// reply. Fetch and the settling methods remember their outcome in Redis
// for a while under a key of their own (onceler:op:<id>), so that a
// repeated call returns the first outcome: the same job, or success,
// rather than a second job or ErrNotHeld. A Fetch that fails without
// knowing whether it moved a job asks again in the next Fetch of the
// client and hands that job out then.
//
// Only the expiry of the heartbeat hash counts as death: a process that
// stopped cleanly leaves "processes" at once but may still be settling the
// jobs it holds. A worker that stops without finishing its jobs calls
// RequeueAll (Sidekiq's bulk_requeue), or they come back after
// HeartbeatTTL.
//
// When no queue has a job, Fetch waits on the first queue of its order
// with a BLMOVE of the queue onto itself (which takes nothing and leaves
// the list as it is) and then moves the job in the script; every waiting
// Fetch wakes for a new job and one of them gets it. A Fetch whose context
// ends while that BLMOVE is in flight returns after its timeout
// (FetchTimeout, 2 s); a job it moved while stopping is put back at the
// head of its queue.
//
// # Queues
//
// Config.Queues follow Sidekiq's -q rule: without weights the queues are
// tried in the given order for every fetch; with weights ("critical,3")
// each fetch tries them in a fresh random order where each queue's chance
// to come first is its weight's share. Redis cannot block on several lists
// while moving reliably, so with several queues Fetch looks at all of them
// in one script and then blocks on the first in its order for FetchPoll
// (1 s) before it looks at all again.
//
// # Redis keys
//
// Sidekiq's, as Sidekiq 6.4 names them (no namespace):
//
//	queue:<name>              list: jobs, LPUSHed by producers, taken from the right
//	queues                    set: queue names
//	schedule, retry           sorted sets: jobs by the time they are due
//	dead                      sorted set: dead jobs by the time they died
//	processes                 set: identities of live processes
//	<identity>                hash: info (JSON), busy, beat, quiet, rtt_us, rss (TTL HeartbeatTTL)
//	<identity>:workers        hash: running jobs, {queue, payload, run_at} JSON by thread id
//	<identity>-signals        list: signals sent through Sidekiq::Process#quiet! and #stop!
//	stat:processed, stat:failed, stat:processed:<yyyy-mm-dd>, stat:failed:<yyyy-mm-dd>
//
// This package's own:
//
//	onceler:working                      hash: identity -> JSON list of its queues (set by every fetch and heartbeat)
//	onceler:working:<identity>:<queue>   list: jobs fetched from <queue>, not settled yet (WorkingKey)
//	onceler:epoch                        hash: identity -> its current epoch (deleted by recovery and RequeueAll)
//	onceler:op:<id>                      outcome of one Fetch (hash, until the job is settled, at most 5 min)
//	                                     or one settlement (string, 1 min)
//
// # Heartbeat, scheduler, signals
//
// Run writes the heartbeat every Heartbeat (5 s) as Sidekiq's launcher
// does: the processed and failed counts since the last beat (Begin and End
// count them), the workers hash of the jobs between Begin and End, then
// the process hash and its entry in "processes", and it reads one signal.
// TSTP makes the process quiet (Quiet reports it; Fetch hands out no more
// jobs and waits for its context); TERM makes it quiet too; every signal
// is then passed to Run's callback, which should stop the worker on TERM.
// The callback runs on a goroutine of its own, one signal at a time, so
// it may block (drain the workers, cancel Run's context and wait for Run
// to return) without delaying the heartbeat; it may be called after Run
// returned. A callback that never returns holds back the signals after
// it.
// When Run's context ends it writes the remaining counts and leaves
// "processes" as Sidekiq does on shutdown.
//
// The scheduler (EnqueueDue) moves due jobs of "retry" and "schedule" to
// their queues, one at a time: a job is pushed only by the caller whose
// ZREM removed it, in the same script, so several processes polling never
// enqueue a job twice and a crash never loses one. The job is enqueued as
// Sidekiq::Client.push would: "retry" true and "queue" "default" when
// absent, a jid and created_at when absent, a fresh enqueued_at. The
// interval is random around PollInterval (default 5 s times the number of
// processes, as Sidekiq scales it); the first poll is at Run's start. An
// entry that is not a JSON object goes to the dead set.
//
// # Retries
//
// Retry follows Sidekiq 6.4's job_retry.rb: see Retry for the fields it
// writes and the delay. A job whose "retry" is false is neither retried
// nor put in the dead set, as in Sidekiq (which only calls its death
// handlers): Retry logs it at warning level and removes it. A job whose
// retries are exhausted goes to the dead set unless its "dead" is false;
// the dead set is trimmed as Sidekiq's DeadSet#kill trims it (entries
// older than DeadTimeout, and all but the newest DeadMaxJobs-1). A
// retry_count that is a float counts truncated; one that is not a number
// (a string, true), on which Sidekiq's own retry fails, sends the job to
// the dead set with error_class "Onceler::InvalidRetryCount".
//
// The dead set holds only job hashes, as Sidekiq's DeadSet needs: a value
// that is JSON but not an object (Kill of an undecodable job, or an entry
// of "schedule" or "retry") is wrapped in a hash of class
// "Onceler::UnreadableJob" whose argument is the value as a string. Two
// identical strings stored in a sorted set would be one member: the
// second gets a field "onceler_copy" instead.
//
// # Jobs and ActiveJob arguments
//
// Decode keeps the fetched string (Job.Raw, never re-encoded: the working
// list is matched by it) and the job hash with numbers as json.Number. For
// a job of ActiveJob's adapter (class JobWrapperClass) Job.Class is the
// wrapped job class and Job.Args its deserialized arguments:
//
//	JSON null, bool, number, string    nil, bool, json.Number, string
//	array                              []any
//	hash (_aj_symbol_keys, _aj_hash_with_indifferent_access)  map[string]any (markers removed)
//	hash with _aj_ruby2_keywords       Keywords (keyword arguments)
//	{"_aj_globalid": gid}              GlobalID (the record is not loaded)
//	Symbol                             Symbol
//	Time, ActiveSupport::TimeWithZone, DateTime    time.Time (with its offset)
//	Date                               time.Time, midnight UTC
//	ActiveSupport::Duration            time.Duration of its value in seconds
//	Module (a class)                   Module (its name)
//	other _aj_serialized objects       Serialized (serializer name, fields)
//
// A job that cannot be decoded is still returned by Fetch, with a
// *DecodeError (ErrBadJSON, ErrMissingClass, ErrBadArgs, ErrBadKey), so that it can
// be sent to the dead set with Kill rather than lost.
//
// Not supported: Sidekiq 7's layout, redis-namespace prefixes, and the
// features of Sidekiq Pro and Enterprise (batches, unique jobs, super
// fetch, rate limiters); Sidekiq's middleware is Ruby code and does not
// run here.
package sidekiq
