package idempotency_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/onceler/onceler/idempotency"
	"github.com/onceler/onceler/internal/testenv"
)

// cutProxy forwards TCP to Postgres; when armed with a byte pattern, it
// forwards the first client write containing it and then cuts the
// connection before the server answers: the write reaches the server, the
// client never learns its outcome.
type cutProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	arm    []byte
	conns  []net.Conn
	wg     sync.WaitGroup
}

func newCutProxy(t *testing.T, target string) *cutProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cutProxy{ln: ln, target: target}
	p.wg.Go(p.accept)
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *cutProxy) setArm(pattern string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.arm = []byte(pattern)
}

func (p *cutProxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, s)
		p.mu.Unlock()
		p.wg.Go(func() {
			_, _ = io.Copy(c, s)
			_ = c.Close()
			_ = s.Close()
		})
		p.wg.Go(func() {
			buf := make([]byte, 64<<10)
			for {
				n, err := c.Read(buf)
				if n > 0 {
					if _, werr := s.Write(buf[:n]); werr != nil {
						return
					}
					p.mu.Lock()
					cut := len(p.arm) > 0 && bytes.Contains(buf[:n], p.arm)
					if cut {
						p.arm = nil
					}
					p.mu.Unlock()
					if cut {
						// The client loses the answer; the server reads the
						// write, then end of stream.
						_ = c.Close()
						_ = s.(*net.TCPConn).CloseWrite()
						return
					}
				}
				if err != nil {
					_ = s.Close()
					return
				}
			}
		})
	}
}

func proxiedPool(t *testing.T) (*pgxpool.Pool, *cutProxy) {
	t.Helper()
	u, err := url.Parse(testenv.DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	proxy := newCutProxy(t, u.Host)
	u.Host = proxy.ln.Addr().String()
	pool, err := pgxpool.New(context.Background(), u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, proxy
}

func TestUnknownOutcomeIsReportedNotGuessed(t *testing.T) {
	for _, disabled := range []bool{false, true} {
		pool, proxy := proxiedPool(t)
		schema := testenv.Schema(t, testenv.Pool(t))
		s, err := idempotency.New(pool, idempotency.Config{Schema: schema, Batch: idempotency.BatchConfig{Disabled: disabled}})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		ctx := context.Background()
		if err := s.Migrate(ctx); err != nil {
			t.Fatal(err)
		}

		// Completion: the connection drops after the write reached the server.
		p := params("pay", "k")
		c := mustClaim(t, s, p, idempotency.OutcomeFirst)
		proxy.setArm(string(c.Token))
		err = s.Complete(ctx, p.Ref(c.Token), []byte(`"paid"`))
		if !idempotency.IsUnknownOutcome(err) || idempotency.IsRetryable(err) {
			t.Fatalf("batched=%v: complete over a cut connection: %v, want unknown outcome", !disabled, err)
		}
		// It did commit; completing again with the same token is a no-op.
		if err := s.Complete(ctx, p.Ref(c.Token), []byte(`"paid"`)); err != nil {
			t.Fatalf("complete again: %v", err)
		}
		if r, err := s.Get(ctx, "pay", "k"); err != nil || r.Status != idempotency.StatusCompleted {
			t.Fatalf("record %+v %v", r, err)
		}

		// Same-database run: the connection drops after COMMIT was sent.
		q := params("credit", "k")
		_, err = s.RunTx(ctx, q, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			proxy.setArm("commit")
			return []byte(`1`), nil
		})
		if !idempotency.IsUnknownOutcome(err) {
			t.Fatalf("run tx over a cut connection: %v, want unknown outcome", err)
		}
		// The server commits once it reads the COMMIT the client lost track of.
		deadline := time.Now().Add(5 * time.Second)
		for {
			r, err := s.Get(ctx, "credit", "k")
			if err == nil && r.Status == idempotency.StatusCompleted {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("run tx record %+v %v", r, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

func TestIsRetryable(t *testing.T) {
	e := newEnv(t, idempotency.BatchConfig{Disabled: true})
	_, err := e.pool.Exec(context.Background(), `DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = '40001'; END $$`)
	if !idempotency.IsRetryable(err) {
		t.Fatalf("serialization failure not retryable: %v", err)
	}
	_, err = e.pool.Exec(context.Background(), `SELECT 1/0`)
	if idempotency.IsRetryable(err) || idempotency.IsRetryable(nil) || idempotency.IsRetryable(idempotency.ErrFenced) {
		t.Fatal("permanent errors reported retryable")
	}
	if !errors.Is(err, err) {
		t.Fatal("unreachable")
	}
}
