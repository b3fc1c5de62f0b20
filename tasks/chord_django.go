package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/onceler/onceler/internal/clip"
)

// DjangoChordTable is the table of django-celery-results' ChordCounter
// model: the caller's DatabaseBackend.apply_chord makes a chord's row
// (group_id, sub_tasks: the header's results as JSON tuples, count: the
// header's size).
const DjangoChordTable = "django_celery_results_chordcounter"

// chordPart is django-celery-results 2.4's
// DatabaseBackend.on_chord_part_return: under the row's lock (SELECT ...
// FOR UPDATE), count goes down by one; once it is 0 and every header part's
// taskresult row is ready (as its deps.ready()), the part publishes the
// body with the parts' results in header order. The row stays at count 0
// until chordDone deletes it once the body is out, so that the redelivery
// of a part that died before publishing publishes it. entry and index are
// not used: the results are read from the taskresult rows.
func (b *djangoBackend) chordPart(ctx context.Context, gid, taskID string, _ *int, _ []byte) (fire bool, joined [][]byte, err error) {
	tx, err := b.pool.Begin(ctx)
	if err != nil {
		return false, nil, fmt.Errorf("django-db chord part of group %s: %w", clip.String(gid, maxLogField), err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	var subTasks string
	var count int64
	err = tx.QueryRow(ctx, `SELECT sub_tasks, count FROM `+DjangoChordTable+` WHERE group_id = $1 FOR UPDATE`, gid).Scan(&subTasks, &count)
	if errors.Is(err, pgx.ErrNoRows) {
		// As django-celery-results ("Can't find ChordCounter"): no body.
		return false, nil, nil
	}
	if err != nil {
		return false, nil, fmt.Errorf("django-db chord counter of group %s: %w", clip.String(gid, maxLogField), err)
	}
	if count > 0 {
		count--
		if _, err := tx.Exec(ctx, `UPDATE `+DjangoChordTable+` SET count = $2 WHERE group_id = $1`, gid, count); err != nil {
			return false, nil, fmt.Errorf("django-db chord counter of group %s: %w", clip.String(gid, maxLogField), err)
		}
	}
	if count == 0 {
		joined, err = b.chordJoin(ctx, tx, subTasks)
		if err != nil {
			return false, nil, fmt.Errorf("django-db chord join of group %s: %w", clip.String(gid, maxLogField), err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return false, nil, fmt.Errorf("django-db chord counter of group %s: %w", clip.String(gid, maxLogField), err)
	}
	return joined != nil, joined, nil
}

// chordJoin reads the results of the header parts listed in sub_tasks
// (JSON of Celery's result tuples, [[task_id, parent], children]) from
// their taskresult rows, as chord join entries [1, task_id, state, result]
// in header order; nil when a part is not ready yet. A header member that
// is itself a group gets an entry that cannot be read, so the chord's body
// gets a ChordError (Join error).
func (b *djangoBackend) chordJoin(ctx context.Context, tx pgx.Tx, subTasks string) ([][]byte, error) {
	var tuples []json.RawMessage
	if err := json.Unmarshal([]byte(subTasks), &tuples); err != nil {
		return nil, fmt.Errorf("%w: sub_tasks is not a JSON list: %w", errDjangoChord, err)
	}
	ids := make([]string, len(tuples))
	nested := make([]bool, len(tuples))
	for i, raw := range tuples {
		var tuple []json.RawMessage
		var head []json.RawMessage
		if err := json.Unmarshal(raw, &tuple); err != nil || len(tuple) != 2 || json.Unmarshal(tuple[0], &head) != nil ||
			len(head) < 1 || json.Unmarshal(head[0], &ids[i]) != nil || ids[i] == "" {
			return nil, fmt.Errorf("%w: sub_tasks member %d is not a result tuple", errDjangoChord, i)
		}
		nested[i] = string(tuple[1]) != "null"
	}
	rows, err := tx.Query(ctx, `SELECT task_id, status, result FROM `+DjangoTaskTable+` WHERE task_id = ANY($1)`, ids)
	if err != nil {
		return nil, err
	}
	type part struct{ status, result string }
	got := map[string]part{}
	for rows.Next() {
		var id, status string
		var result *string
		if err := rows.Scan(&id, &status, &result); err != nil {
			return nil, err
		}
		r := "null"
		if result != nil {
			r = *result
		}
		got[id] = part{status, r}
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	joined := make([][]byte, len(ids))
	for i, id := range ids {
		if nested[i] {
			joined[i] = []byte(`"a group in a chord header is not supported with the django-db backend"`)
			continue
		}
		p, ok := got[id]
		if !ok || (p.status != "SUCCESS" && p.status != "FAILURE" && p.status != "REVOKED") {
			return nil, nil
		}
		idText, _ := json.Marshal(id)
		joined[i] = fmt.Appendf(nil, `[1, %s, %q, %s]`, idText, p.status, p.result)
	}
	return joined, nil
}

func (b *djangoBackend) chordDone(ctx context.Context, gid string) error {
	if _, err := b.pool.Exec(ctx, `DELETE FROM `+DjangoChordTable+` WHERE group_id = $1`, gid); err != nil {
		return fmt.Errorf("django-db delete chord counter of group %s: %w", clip.String(gid, maxLogField), err)
	}
	return nil
}
