package amqp

import (
	"errors"
	"fmt"
	"maps"
	"reflect"
	"regexp"
	"strconv"

	amqp091 "github.com/onceler/onceler/internal/amqp091"
	"github.com/onceler/onceler/internal/intval"
)

// maxLearnSteps bounds the declares that learn the arguments of one queue:
// more than RabbitMQ has arguments it compares.
const maxLearnSteps = 32

// learn finds the flags and arguments of the existing queue q, trying
// those of from first. AMQP has no method that reads a queue's
// arguments, but RabbitMQ answers a declare whose flags or arguments differ
// from the queue's with 406 naming the first one that differs and its
// current value ("inequivalent arg 'x-max-priority' for queue 'q' in vhost
// '/': received none but current is the value '10' of type 'signedint'").
// Declaring again with that value, on a new channel, until the declare is
// accepted gives every flag and argument the broker compares, which are
// those it acts on (x-queue-type, x-max-priority, x-message-ttl,
// x-dead-letter-*, x-max-length*, x-overflow, x-expires,
// x-single-active-consumer, ...). An accepted declare of a queue that
// exists changes nothing. When the broker does not tell (no configure
// permission, an answer that cannot be read), the state says so and keeps
// the configured flags and arguments. An error is a lost channel or
// connection.
func learn(sc *scratch, q QueueSpec, from QueueSpec) (queueState, error) {
	configured := q.declaredArgs()
	args := maps.Clone(from.Args)
	if args == nil {
		args = map[string]any{}
	}
	durable, autoDelete := from.Durable, from.AutoDelete
	unlearned := func(why error) (queueState, error) {
		return queueState{spec: q, unlearned: why}, nil
	}
	for range maxLearnSteps {
		t, err := toTable(args)
		if err != nil {
			return unlearned(err)
		}
		err = sc.do(func(ch *amqp091.Channel) error {
			_, err := ch.QueueDeclare(q.Name, durable, autoDelete, false, false, t)
			return err
		})
		if err == nil {
			found := q
			found.Durable, found.AutoDelete, found.Quorum, found.Args = durable, autoDelete, false, nil
			if len(args) > 0 {
				found.Args = args
			}
			differs := durable != q.Durable || autoDelete != q.AutoDelete || !sameArgs(configured, found.Args)
			return queueState{spec: found, learned: true, differs: differs}, nil
		}
		ae := brokerError(err)
		if ae == nil || (ae.Code != amqp091.PreconditionFailed && ae.Code != amqp091.AccessRefused) {
			return queueState{}, declareError(err, "queue", q.Name, describeDeclare(durable, autoDelete, args))
		}
		err = declareError(err, "queue", q.Name, describeDeclare(durable, autoDelete, args))
		var pe *PreconditionError
		if !errors.As(err, &pe) || pe.Arg == "" {
			return unlearned(err)
		}
		v, present, ok := parseCurrent(pe.Arg, pe.Current)
		if !ok {
			return unlearned(fmt.Errorf("unreadable value of %s in the broker's answer: %w", pe.Arg, err))
		}
		switch pe.Arg {
		case "durable", "auto_delete":
			b, _ := v.(bool)
			if pe.Arg == "durable" {
				durable = b
			} else {
				autoDelete = b
			}
		default:
			old, had := args[pe.Arg]
			if had == present && (!present || sameArg(old, v)) {
				return unlearned(fmt.Errorf("the broker's answer does not change %s: %w", pe.Arg, err))
			}
			if present {
				args[pe.Arg] = v
			} else {
				delete(args, pe.Arg)
			}
		}
	}
	return unlearned(fmt.Errorf("queue %q: more than %d differences", q.Name, maxLearnSteps))
}

var (
	// typedValue is RabbitMQ's rendering of an argument's value.
	typedValue = regexp.MustCompile(`^the value '(.*)' of type '([a-z]+)'$`)
	// quotedValue is its rendering of a flag or of a plain value.
	quotedValue = regexp.MustCompile(`^'(.*)'$`)
)

// parseCurrent reads the current value in a 406 answer ("none", "the value
// '10' of type 'signedint'", "'false'") of key. present is false for
// "none"; ok is false when the text cannot be read.
func parseCurrent(key, s string) (v any, present, ok bool) {
	if s == "none" {
		return nil, false, key != "durable" && key != "auto_delete"
	}
	if m := typedValue.FindStringSubmatch(s); m != nil {
		v, ok := typedArg(m[1], m[2])
		return v, ok, ok
	}
	if m := quotedValue.FindStringSubmatch(s); m != nil {
		if key == "durable" || key == "auto_delete" {
			b, err := strconv.ParseBool(m[1])
			return b, err == nil, err == nil
		}
		return m[1], true, true
	}
	return nil, false, false
}

// typedArg converts an argument's text to the Go type amqp091 encodes as
// RabbitMQ's type typ.
func typedArg(text, typ string) (any, bool) {
	switch typ {
	case "longstr", "shortstr":
		return text, true
	case "bool":
		b, err := strconv.ParseBool(text)
		return b, err == nil
	case "byte":
		n, err := strconv.ParseInt(text, 10, 8)
		return int8(n), err == nil
	case "short":
		n, err := strconv.ParseInt(text, 10, 16)
		return int16(n), err == nil
	case "signedint":
		n, err := strconv.ParseInt(text, 10, 32)
		return int32(n), err == nil
	case "long", "unsignedbyte", "unsignedshort", "unsignedint":
		n, err := strconv.ParseInt(text, 10, 64)
		return n, err == nil
	case "float":
		f, err := strconv.ParseFloat(text, 32)
		return float32(f), err == nil
	case "double":
		f, err := strconv.ParseFloat(text, 64)
		return f, err == nil
	}
	return nil, false
}

// sameArgs reports whether two argument sets are equal, integers compared
// by value whatever their width (as RabbitMQ compares them).
func sameArgs(a, b map[string]any) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		w, ok := b[k]
		if !ok || !sameArg(v, w) {
			return false
		}
	}
	return true
}

// sameArg compares two queue arguments; numbers by value, as RabbitMQ
// acts on a whole double (1.0 from JSON, a Python float in kombu's
// queue_arguments) as on the integer.
func sameArg(a, b any) bool {
	if x, ok := intval.Whole(a); ok {
		y, ok := intval.Whole(b)
		return ok && x == y
	}
	return reflect.DeepEqual(a, b)
}
