package idempotency_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
)

// A store on a pool whose connections use another query execution mode
// (a DSN's default_query_exec_mode, as with PgBouncer's simple protocol)
// claims and completes batches of keys as on the default one.
func TestBatchUnderEveryExecMode(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"cache_statement", "cache_describe", "describe_exec", "exec", "simple_protocol"} {
		t.Run(mode, func(t *testing.T) {
			url := testenv.DatabaseURL(t)
			sep := "?"
			if strings.Contains(url, "?") {
				sep = "&"
			}
			pool, err := pgxpool.New(context.Background(), url+sep+"default_query_exec_mode="+mode)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			schema := testenv.Schema(t, pool)
			s, err := idempotency.New(pool, idempotency.Config{Schema: schema})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(s.Close)
			ctx := context.Background()
			if err := s.Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			odd := []string{`a"b`, `{x,y}`, `NULL`, ``, `back\slash`, `é`}
			var wg sync.WaitGroup
			claims := make([]idempotency.Claim, len(odd))
			for i, k := range odd {
				wg.Go(func() {
					p := params("t", fmt.Sprintf("%s-%d", k, i))
					p.Owner, p.TaskID = k, k
					c, err := s.Claim(ctx, p)
					if err != nil {
						t.Errorf("claim %q: %v", k, err)
					}
					claims[i] = c
				})
			}
			wg.Wait()
			for i, k := range odd {
				wg.Go(func() {
					key := fmt.Sprintf("%s-%d", k, i)
					if _, err := s.Complete(ctx, params("t", key).Ref(claims[i].Token), []byte(`1`)); err != nil {
						t.Errorf("complete %q: %v", key, err)
					}
				})
			}
			wg.Wait()
			for i, k := range odd {
				key := fmt.Sprintf("%s-%d", k, i)
				r, err := s.Get(ctx, "t", key)
				if err != nil || r.Status != idempotency.StatusCompleted || r.Owner != k || r.TaskID != k {
					t.Errorf("record %q: %+v %v", key, r, err)
				}
			}
		})
	}
}
