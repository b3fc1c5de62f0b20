package main

import (
	"fmt"
	"os"
	"strings"
	"time"
)

// report renders the results as markdown: the command, the machine, the
// table and the targets.
func report(o options, rows []row) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "Command: `go run ./integration/bench %s`  \n", strings.Join(os.Args[1:], " "))
	fmt.Fprintf(&sb, "Machine: %s; %s UTC; N = %d; the worker %s; raw consumer prefetch %d.\n\n",
		machine(o.workerProcs), time.Now().UTC().Format("2006-01-02 15:04"), o.n, o.workerSettings(), o.rawPrefetch())
	var a, e, sRaw, sqsRaw float64
	for _, r := range rows {
		switch r.sc.ID {
		case "a":
			a = r.rate
		case "e":
			e = r.rate
		case "s-raw":
			sRaw = r.rate
		case "sqs-raw":
			sqsRaw = r.rate
		}
	}
	sb.WriteString("| scenario | tasks | tasks/s | vs (a) | vs (e) | p50 ms | p99 ms | load for latency | raw consumer p50 / p99 ms at that load | peak RSS MiB | PG commits/task | consumer CPU µs/task | PG backend CPU µs/task | broker CPU µs/task |\n")
	sb.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range rows {
		if r.drainError != nil {
			fmt.Fprintf(&sb, "| (%s) %s | %d | failed: %s | | | | | | | | | | | |\n", r.sc.ID, r.sc.Title, r.n,
				strings.ReplaceAll(r.drainError.Error(), "|", "/"))
			continue
		}
		ratio := func(base float64) string {
			if base <= 0 {
				return "–"
			}
			return fmt.Sprintf("%.2f×", r.rate/base)
		}
		lat := func(d time.Duration) string {
			if r.lat.n == 0 {
				return "–"
			}
			return ms(d)
		}
		floor := "–"
		if r.floor.n > 0 {
			floor = ms(r.floor.p50) + " / " + ms(r.floor.p99)
			if r.floor.busy > 0 {
				floor += fmt.Sprintf(" (CPU %.0f%% busy)", 100*r.floor.busy)
			}
		}
		load, rss, commits, cpu, pgCPU, brokerCPU := "–", "–", "–", "–", "–", "–"
		if r.brokerCPUUS > 0 {
			brokerCPU = fmt.Sprintf("%.0f", r.brokerCPUUS)
		}
		if r.cpuUS > 0 {
			cpu = fmt.Sprintf("%.0f", r.cpuUS)
		}
		if r.pgCPUUS > 0 {
			pgCPU = fmt.Sprintf("%.0f", r.pgCPUUS)
		}
		if r.lat.n > 0 {
			load = fmt.Sprintf("%.0f/s", r.latRate)
			if r.sustained > 0 {
				load += fmt.Sprintf(", half the %.0f/s sustained", r.sustained)
			}
			if r.lat.busy > 0 {
				load += fmt.Sprintf(" (CPU %.0f%% busy)", 100*r.lat.busy)
			}
		}
		if r.rssKiB > 0 {
			rss = fmt.Sprintf("%.1f", float64(r.rssKiB)/1024)
		}
		if r.sc.Kind != "raw" && r.sc.Kind != "sidekiq-raw" && r.sc.Kind != "sqs-raw" {
			commits = fmt.Sprintf("%.3f", r.commits)
		}
		title := r.sc.Title
		if r.note != "" {
			title += " (" + r.note + ")"
		}
		if r.sc.Kind == "sidekiq" && sRaw > 0 {
			title += fmt.Sprintf(" (%.2f× (s-raw))", r.rate/sRaw)
		}
		if r.sc.Kind == "sqs" && sqsRaw > 0 {
			title += fmt.Sprintf(" (%.2f× (sqs-raw))", r.rate/sqsRaw)
		}
		if r.lat.p99Cold > 0 {
			title += fmt.Sprintf(" (p99 with the warm-up's messages: %s ms)", ms(r.lat.p99Cold))
		}
		if r.halfDrain.n > 0 {
			title += fmt.Sprintf(" (at half the drain rate, %.0f/s, CPU %.0f%% busy: p50 %s, p99 %s ms)",
				r.rate/2, 100*r.halfDrain.busy, ms(r.halfDrain.p50), ms(r.halfDrain.p99))
		}
		title += disturbance("latency run", r.lat) + disturbance("raw consumer's latency run", r.floor) +
			disturbance("latency run at half the drain rate", r.halfDrain)
		fmt.Fprintf(&sb, "| (%s) %s | %d | %.0f | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", r.sc.ID, title, r.n, r.rate,
			ratio(a), ratio(e), lat(r.lat.p50), lat(r.lat.p99), load, floor, rss, commits, cpu, pgCPU, brokerCPU)
	}
	sb.WriteString("\n")
	sb.WriteString(targets(rows))
	return sb.String()
}

// disturbance says which of a row's latency runs the broker's epmd check
// overlapped (brokerSpawnMark): set aside and measured again, or, when every
// attempt was, kept.
func disturbance(what string, l latStats) string {
	switch {
	case l.disturbed:
		return fmt.Sprintf(" (every %s overlapped the broker's once-a-minute epmd check: the last kept)", what)
	case l.setAside == 1:
		return fmt.Sprintf(" (%s measured again: the first overlapped the broker's once-a-minute epmd check)", what)
	case l.setAside > 1:
		return fmt.Sprintf(" (%s measured again: %d overlapped the broker's once-a-minute epmd check)", what, l.setAside)
	}
	return ""
}

// ms is d in milliseconds, one decimal.
func ms(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d.Microseconds())/1000) }

// targets checks the measured numbers against the goals.
func targets(rows []row) string {
	by := map[string]row{}
	for _, r := range rows {
		if r.drainError == nil {
			by[r.sc.ID] = r
		}
	}
	var sb strings.Builder
	check := func(name string, ok, known bool, got string) {
		status := "met"
		switch {
		case !known:
			status = "not measured"
		case !ok:
			status = "MISSED"
		}
		fmt.Fprintf(&sb, "- %s: %s (%s)\n", name, status, got)
	}
	a, okA := by["a"]
	b, okB := by["b"]
	b2, okB2 := by["b'"]
	c, okC := by["c"]
	e, okE := by["e"]
	hot, okHot := by["b'-hot"]
	frac := func(x, y row) float64 { return x.rate / y.rate }
	check("(b) ≥ 60% of (a)", okA && okB && frac(b, a) >= 0.6, okA && okB, fmt.Sprintf("%.0f%%", 100*frac(b, a)))
	check("(b) ≥ 10× (e)", okB && okE && frac(b, e) >= 10, okB && okE, fmt.Sprintf("%.1f×", frac(b, e)))
	check("(b') ≥ 45% of (a)", okA && okB2 && frac(b2, a) >= 0.45, okA && okB2, fmt.Sprintf("%.0f%%", 100*frac(b2, a)))
	check("(c) ≥ 45% of (a)", okA && okC && frac(c, a) >= 0.45, okA && okC, fmt.Sprintf("%.0f%%", 100*frac(c, a)))
	check("(b'-hot) ≥ 20% of (a)", okA && okHot && frac(hot, a) >= 0.2, okA && okHot, fmt.Sprintf("%.0f%%", 100*frac(hot, a)))
	for _, x := range []struct {
		id string
		r  row
		ok bool
	}{{"b", b, okB}, {"b'", b2, okB2}, {"c", c, okC}} {
		got := ms(x.r.lat.p99) + " ms"
		if x.r.sustained > 0 {
			got += fmt.Sprintf(" at %.0f/s, half the %.0f/s sustained", x.r.latRate, x.r.sustained)
		}
		if x.r.floor.n > 0 {
			got += "; the raw consumer at that load: " + ms(x.r.floor.p99) + " ms"
		}
		name := "(" + x.id + ") p99 at half load ≤ 20 ms"
		if x.r.sustained > 0 {
			name = "(" + x.id + ") p99 at half load (half the sustained rate) ≤ 20 ms"
		}
		check(name, x.ok && x.r.lat.n > 0 && x.r.lat.p99 <= 20*time.Millisecond, x.ok && x.r.lat.n > 0, got)
		if x.r.halfDrain.n > 0 {
			fmt.Fprintf(&sb, "- (%s) p99 at half the drain rate (%.0f/s, CPU %.0f%% busy): %s ms (measured, no target)\n",
				x.id, x.r.rate/2, 100*x.r.halfDrain.busy, ms(x.r.halfDrain.p99))
		}
	}
	var peak int64
	for _, r := range rows {
		if r.drainError == nil && r.sc.Kind == "worker" {
			peak = max(peak, r.rssKiB)
		}
	}
	check("worker peak RSS ≤ 100 MiB (every worker scenario)", peak > 0 && peak <= 100*1024, peak > 0, fmt.Sprintf("%.1f MiB", float64(peak)/1024))
	check("(b) PostgreSQL commits per task ≤ 0.1", okB && b.commits <= 0.1, okB, fmt.Sprintf("%.3f", b.commits))
	f, okF := by["f"]
	check("(f) events and remote control cost < 5% of (b)'s throughput", okF && f.pairRatio >= 0.95, okF,
		fmt.Sprintf("median (f)/(b) over the rounds %.3f, a cost of %.1f%%", f.pairRatio, 100*(1-f.pairRatio)))
	if st, tx := by["b'"], by["b'-tx"]; st.rate > 0 && tx.rate > 0 {
		fmt.Fprintf(&sb, "- (b') / (b'-tx), the credit returned by RunStmt against the same statement run by a RunTx function: %.2f× (measured, no target)\n", frac(st, tx))
	}
	if s, sRaw := by["s"], by["s-raw"]; s.rate > 0 && sRaw.rate > 0 {
		fmt.Fprintf(&sb, "- (s) / (s-raw), onceler's Sidekiq drain against the Redis ceiling: %.0f%% (measured, no target)\n", 100*frac(s, sRaw))
	}
	if s, sRaw := by["sqs"], by["sqs-raw"]; s.rate > 0 && sRaw.rate > 0 {
		fmt.Fprintf(&sb, "- (sqs) / (sqs-raw), onceler's SQS drain against the raw receive-and-delete ceiling on the same server: %.0f%% (measured, no target)\n", 100*frac(s, sRaw))
	}
	return sb.String()
}
