package sqs

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
)

// slowWriteConn pauses after each write, as a busy machine can pause the
// transport's writing goroutine between sending a request's body and
// finishing the request's write.
type slowWriteConn struct {
	net.Conn
	pause time.Duration
}

func (c slowWriteConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	time.Sleep(c.pause)
	return n, err
}

// TestReceiveWhileRequestWriteFinishes: a receive whose response arrives,
// and is read, while the transport is still finishing the request's write
// gets its messages. The server answers as soon as it has read the body
// and sends the response's body a little later; the client's connection
// pauses after each write. The SDK closes the request's body once the
// response's headers are in: with the transport writing from that body,
// the end of the write failed and the transport closed the connection
// under the response ("use of closed network connection"), every time.
func TestReceiveWhileRequestWriteFinishes(t *testing.T) {
	var srv *httptest.Server
	srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := r.ParseForm(); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "text/xml")
		switch r.Form.Get("Action") {
		case "GetQueueUrl":
			fmt.Fprintf(w, `<GetQueueUrlResponse><GetQueueUrlResult><QueueUrl>%s/000000000000/%s</QueueUrl></GetQueueUrlResult>`+
				`<ResponseMetadata><RequestId>1</RequestId></ResponseMetadata></GetQueueUrlResponse>`, srv.URL, r.Form.Get("QueueName"))
		case "ReceiveMessage":
			w.WriteHeader(http.StatusOK)
			w.(http.Flusher).Flush()
			time.Sleep(100 * time.Millisecond)
			fmt.Fprint(w, `<ReceiveMessageResponse><ReceiveMessageResult>`)
			for i := range 2 {
				fmt.Fprintf(w, `<Message><MessageId>m%d</MessageId><ReceiptHandle>h%d</ReceiptHandle><Body>[%d]</Body></Message>`, i, i, i)
			}
			fmt.Fprint(w, `</ReceiveMessageResult><ResponseMetadata><RequestId>2</RequestId></ResponseMetadata></ReceiveMessageResponse>`)
		default:
			http.Error(w, "unexpected action "+r.Form.Get("Action"), http.StatusBadRequest)
		}
	}))
	defer srv.Close()

	dialer := &net.Dialer{}
	tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := dialer.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return slowWriteConn{Conn: conn, pause: 30 * time.Millisecond}, nil
	}}
	ac := aws.Config{Region: "us-east-1", Credentials: credentials.NewStaticCredentialsProvider("test", "test", "")}
	c := newClient(ac, tr, Config{Endpoint: srv.URL})
	defer func() { _ = c.Close() }()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for round := range 3 {
		msgs, err := c.Receive(ctx, "q", MaxBatch, 0, time.Minute)
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		if len(msgs) != 2 || msgs[0].Body != "[0]" || msgs[1].ReceiptHandle != "h1" {
			t.Fatalf("round %d: received %+v, want the two messages", round, msgs)
		}
	}
}

// closeCounter is a request body that counts its closes.
type closeCounter struct {
	*strings.Reader
	closes int
}

func (c *closeCounter) Close() error { c.closes++; return nil }

// TestOwnBodies: the request the transport gets carries the body's bytes
// with their length (an empty body as no body, not a chunked one), the
// caller's request is left as it was, and its body is closed once.
func TestOwnBodies(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "%d %q %v", r.ContentLength, b, r.TransferEncoding)
	}))
	defer srv.Close()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	for _, tc := range []struct{ body, want string }{
		{"Action=ReceiveMessage", `21 "Action=ReceiveMessage" []`},
		{"", `0 "" []`},
	} {
		body := &closeCounter{Reader: strings.NewReader(tc.body)}
		req, err := http.NewRequest(http.MethodPost, srv.URL, body)
		if err != nil {
			t.Fatal(err)
		}
		req.ContentLength = int64(len(tc.body))
		resp, err := ownBodies{tr}.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if string(got) != tc.want {
			t.Errorf("body %q: server saw %s, want %s", tc.body, got, tc.want)
		}
		if body.closes != 1 || req.Body != io.ReadCloser(body) || req.GetBody != nil {
			t.Errorf("body %q: closed %d times, caller's request changed: %v", tc.body, body.closes, req.Body != io.ReadCloser(body))
		}
	}
}
