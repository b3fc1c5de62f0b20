package testkit

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// redisTestDBs are the Redis databases RedisDB hands out, one test each:
// not 0 and 9, which other tests and the benchmark use.
var redisTestDBs = []int{1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15}

// redisDBLock is the key that marks a database as taken.
const redisDBLock = "onceler-test:sidekiq-db-lock"

// RedisDB takes a free database of the Redis at addr for tb (one holding
// nothing but the lock it takes with SET NX: another test's data is left
// alone), flushed when tb ends, and returns its URL and a client of it. It
// waits up to 3 minutes for one to be free.
func RedisDB(tb testing.TB, addr string) (string, *redis.Client) {
	tb.Helper()
	token := Name("lock")
	deadline := time.Now().Add(3 * time.Minute)
	for {
		for _, db := range redisTestDBs {
			rdb := redis.NewClient(&redis.Options{Addr: addr, DB: db, DisableIdentity: true})
			ctx := context.Background()
			ok, err := rdb.SetNX(ctx, redisDBLock, token, 15*time.Minute).Result()
			if err != nil {
				_ = rdb.Close()
				tb.Fatalf("lock Redis db %d: %v", db, err)
			}
			if !ok {
				_ = rdb.Close()
				continue
			}
			if n, _ := rdb.DBSize(ctx).Result(); n != 1 {
				_ = rdb.Del(ctx, redisDBLock)
				_ = rdb.Close()
				continue
			}
			tb.Cleanup(func() {
				ctx := context.Background()
				if v, _ := rdb.Get(ctx, redisDBLock).Result(); v == token {
					_ = rdb.FlushDB(ctx).Err()
				}
				_ = rdb.Close()
			})
			return fmt.Sprintf("redis://%s/%d", addr, db), rdb
		}
		if time.Now().After(deadline) {
			tb.Fatal("no free Redis database for the test")
		}
		time.Sleep(200 * time.Millisecond)
	}
}
