# Test helper: Ruby Sidekiq 6.4 (and ActiveJob's Sidekiq adapter) as the
# producer of jobs and the reader of what the Go package writes. The Redis
# database is REDIS_URL's. Usage: ruby sidekiq_helper.rb COMMAND [JSON]
# Output: one JSON document on stdout; logs go to stderr.
require "json"
require "logger"
require "sidekiq"
require "sidekiq/api"
require "sidekiq/job_retry"
require "active_job"
require "active_job/queue_adapters/sidekiq_adapter"
require "globalid"

Sidekiq.logger = Logger.new($stderr, level: Logger::WARN)
ActiveJob::Base.logger = Logger.new(nil)
ActiveJob::Base.queue_adapter = :sidekiq
GlobalID.app = "onceler-test"

class HardWorker
  include Sidekiq::Worker
end

class Person
  include GlobalID::Identification
  attr_reader :id
  def initialize(id)
    @id = id
  end

  def self.find(id)
    new(id)
  end
end

class ReportJob < ActiveJob::Base
  def perform(*args, **kw)
  end
end

def entries(set)
  set.map { |e|
    {"score" => e.score, "jid" => e.jid, "item" => e.item, "value" => e.value,
     "klass" => e.klass, "display_class" => e.display_class, "error_backtrace" => e.error_backtrace}
  }
end

cmd = ARGV[0]
arg = ARGV[1] ? JSON.parse(ARGV[1]) : {}
out = case cmd
when "push"
  # arg: a job hash, as Sidekiq::Client.push takes it ("class" a String)
  Sidekiq::Client.push(arg)
when "push_many"
  arg.map { |item| Sidekiq::Client.push(item) }
when "push_bulk"
  # stdin: a JSON array of {"class", "queue", "args": [[...], ...]}, each
  # pushed with Sidekiq::Client.push_bulk; output: how many jobs were pushed
  JSON.parse($stdin.read).sum { |bulk| Sidekiq::Client.push_bulk(bulk).size }
when "perform_in"
  # arg: {"seconds": n, "queue": q, "args": [...]}
  HardWorker.set(queue: arg["queue"]).perform_in(arg["seconds"], *arg["args"])
when "activejob"
  # arg: {"queue": q}; the job's arguments cover ActiveJob's serialisers
  job = ReportJob.set(queue: arg["queue"]).perform_later(
    "plain", 7, 2.5, nil, true, [1, "two"],
    :sym,
    {"s" => 1, :k => "v"},
    ActiveSupport::HashWithIndifferentAccess.new("ia" => 1),
    Person.new(42),
    Time.utc(2024, 3, 4, 5, 6, 7, 123456),
    Date.new(2024, 3, 4),
    90.seconds,
    ReportJob,
    kw: "word"
  )
  {"job_id" => job.job_id, "jid" => job.provider_job_id}
when "retries"
  entries(Sidekiq::RetrySet.new)
when "dead"
  entries(Sidekiq::DeadSet.new)
when "scheduled"
  entries(Sidekiq::ScheduledSet.new)
when "processes"
  Sidekiq::ProcessSet.new.map { |p| p.instance_variable_get(:@attribs) }
when "workers"
  Sidekiq::Workers.new.map { |process, tid, work| {"process" => process, "tid" => tid, "work" => work} }
when "stats"
  s = Sidekiq::Stats.new
  {"processed" => s.processed, "failed" => s.failed, "retry_size" => s.retry_size,
   "dead_size" => s.dead_size, "scheduled_size" => s.scheduled_size,
   "processes_size" => s.processes_size, "workers_size" => s.workers_size}
when "signal"
  # arg: {"identity": id, "signal": "TSTP" | "TERM"}
  process = Sidekiq::Process.new("identity" => arg["identity"])
  case arg["signal"]
  when "TSTP" then process.quiet!
  when "TERM" then process.stop!
  else abort "unknown signal #{arg["signal"]}"
  end
  true
when "job_retry"
  # arg: {"job": jobstr, "queue": q, "message": m}: Sidekiq's JobRetry
  # handles the failure of the job, as a Sidekiq process does; prints
  # where the job went.
  begin
    Sidekiq::JobRetry.new.local(HardWorker.new, arg["job"], arg["queue"]) { raise arg["message"] || "boom" }
  rescue Sidekiq::JobRetry::Skip
    "handled"
  rescue => e
    "#{e.class}: #{e.message}"
  end.then { |how|
    {"how" => how,
     "retry" => Sidekiq.redis { |c| c.zrange("retry", 0, -1) },
     "dead" => Sidekiq.redis { |c| c.zrange("dead", 0, -1) }}
  }
when "queue"
  # arg: {"queue": q}: the queue's jobs, next to be fetched first
  Sidekiq::Queue.new(arg["queue"]).map(&:item)
else
  abort "unknown command #{cmd}"
end
puts JSON.generate(out)
