package tasks

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/onceler/onceler/internal/testkit"
)

// TestHealthHandler: /readyz answers 200 only while the worker consumes.
func TestHealthHandler(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	cfg := e.config()
	cfg.Pool = testenvPool(t)
	w, err := NewWorker(testRegistry(t, &effects{}), cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(w.HealthHandler())
	defer srv.Close()
	status := func(path string) int {
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	if s := status("/readyz"); s != http.StatusServiceUnavailable {
		t.Errorf("readyz before Run: %d", s)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	testkit.WaitFor(t, "ready", 10*time.Second, func() bool { return status("/readyz") == http.StatusOK })
	if s := status("/healthz"); s != http.StatusOK {
		t.Errorf("healthz while running: %d", s)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if s := status("/readyz"); s != http.StatusServiceUnavailable {
		t.Errorf("readyz after Run: %d", s)
	}
	srv.CloseClientConnections()
}
