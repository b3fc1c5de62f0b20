package main

import (
	"fmt"
	"os"
	"strconv"

	"github.com/onceler/onceler/celeryproto"
	"github.com/onceler/onceler/demo"
)

// Task names of the bench tasks, served by the Go worker and by the Python
// script alike.
const (
	taskOutside = "bench.outside"
	// taskCredit is the onceler binary's demo.ledger.credit (package demo):
	// same-database, a ledger row and the account's balance row.
	taskCredit = demo.TaskCredit
	// taskCreditTx is the same statement in a RunTx function (child.go).
	taskCreditTx = "bench.credit_tx"
)

// creditCents is what every bench credit adds.
const creditCents = 125

// msgSpec says what messages to build.
type msgSpec struct {
	Task     string
	N        int
	RunID    string
	ReplyTo  string // "" and IgnoreResult true: nobody waits for a result
	Ignore   bool
	DupEvery int // every DupEvery-th message repeats an earlier operation (0: none)
	DupGap   int // how far back the repeated operation is
	Accounts int // taskCredit: the accounts the credits go to, in turn
}

// account is the account of the i-th credit.
func (s msgSpec) account(i int) string {
	return s.RunID + "-acct-" + strconv.Itoa(i%max(1, s.Accounts))
}

// ops returns the operation id of each message.
func (s msgSpec) ops() []string {
	ops := make([]string, s.N)
	for i := range ops {
		if s.DupEvery > 0 && i%s.DupEvery == s.DupEvery-1 && i >= s.DupGap {
			ops[i] = ops[i-s.DupGap]
			continue
		}
		ops[i] = s.RunID + "-" + strconv.Itoa(i)
	}
	return ops
}

// build encodes the messages as a Celery 5.2.6 producer sends them
// (app.send_task(name, args=[op]): protocol 2, JSON, the headers and
// properties of celeryproto/testdata/golden/p2_json_basic.json).
func (s msgSpec) build() ([]*celeryproto.Publishing, []string, error) {
	host, _ := os.Hostname()
	origin := "gen" + strconv.Itoa(os.Getpid()) + "@" + host
	ops := s.ops()
	out := make([]*celeryproto.Publishing, len(ops))
	for i, op := range ops {
		id := celeryproto.NewTaskID()
		args, repr := []any{op}, "['"+op+"']"
		if credits(s.Task) {
			acct := s.account(i)
			args, repr = []any{acct, op, creditCents}, fmt.Sprintf("['%s', '%s', %d]", acct, op, creditCents)
		}
		m := &celeryproto.Message{
			Protocol: 2, Task: s.Task, ID: id, Args: args, Kwargs: map[string]any{},
			RootID: id, Origin: origin, ArgsRepr: repr, KwargsRepr: "{}",
			ReplyTo: s.ReplyTo, IgnoreResult: s.Ignore,
		}
		p, err := celeryproto.EncodeTask(m, celeryproto.EncodeOptions{Protocol: 2})
		if err != nil {
			return nil, nil, fmt.Errorf("encode message %d: %w", i, err)
		}
		out[i] = p
	}
	return out, ops, nil
}

// credits reports whether task is a ledger credit: demo.ledger.credit's
// arguments, checked against the demo's ledger.
func credits(task string) bool { return task == taskCredit || task == taskCreditTx }
