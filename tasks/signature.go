package tasks

import (
	"errors"
	"fmt"
	"time"

	"github.com/onceler/onceler/celeryproto"
)

// Reading signature options (as Celery's frozen signatures carry them) and
// writing Celery's argsrepr/kwargsrepr for the workflow steps onceler
// publishes.

func optString(o map[string]any, k string) string {
	s, _ := o[k].(string)
	return s
}

func optNumber(o map[string]any, k string) (float64, bool) {
	switch v := o[k].(type) {
	case int64:
		return float64(v), true
	case float64:
		return v, true
	case int:
		return float64(v), true
	}
	return 0, false
}

func seconds(v float64) time.Duration { return time.Duration(v * float64(time.Second)) }

// optSignatures reads options.link / options.link_error: a signature or a
// list of them.
func optSignatures(o map[string]any, k string) ([]celeryproto.Signature, error) {
	switch v := o[k].(type) {
	case nil:
		return nil, nil
	case map[string]any:
		s, err := sigFrom(v)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", k, err)
		}
		return []celeryproto.Signature{s}, nil
	case []any:
		out := make([]celeryproto.Signature, 0, len(v))
		for _, e := range v {
			m, ok := e.(map[string]any)
			if !ok {
				return nil, fmt.Errorf("%s: element is not a signature", k)
			}
			s, err := sigFrom(m)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", k, err)
			}
			out = append(out, s)
		}
		return out, nil
	}
	return nil, fmt.Errorf("%s: not a signature", k)
}

func sigFrom(m map[string]any) (celeryproto.Signature, error) {
	var s celeryproto.Signature
	var ok bool
	if s.Task, ok = m["task"].(string); !ok || s.Task == "" {
		return s, errors.New("signature without a task name")
	}
	if v, present := m["args"]; present && v != nil {
		if s.Args, ok = v.([]any); !ok {
			return s, errors.New("signature args is not a list")
		}
	}
	if v, present := m["kwargs"]; present && v != nil {
		if s.Kwargs, ok = v.(map[string]any); !ok {
			return s, errors.New("signature kwargs is not a mapping")
		}
	}
	if v, present := m["options"]; present && v != nil {
		if s.Options, ok = v.(map[string]any); !ok {
			return s, errors.New("signature options is not a mapping")
		}
	}
	s.SubtaskType, _ = m["subtask_type"].(string)
	s.Immutable, _ = m["immutable"].(bool)
	return s, nil
}
