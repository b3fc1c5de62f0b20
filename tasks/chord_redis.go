package tasks

import (
	"context"
	"fmt"
	"strconv"

	"github.com/redis/go-redis/v9"

	"github.com/onceler/onceler/internal/clip"
)

// GroupKeyPrefix is the prefix of a group's keys in a key-value result
// backend, as Celery's BaseKeyValueStoreBackend.group_keyprefix. A chord's
// counters are <prefix><group id>.j (the join sorted set), .t (parts added
// later, add_to_chord) and .s (the header's size, set by the caller).
const GroupKeyPrefix = "celery-taskset-meta-"

// chordPartScript is Celery's RedisBackend.on_chord_part_return pipeline
// (MULTI: ZADD .j, ZCOUNT .j, GET .t, GET .s, EXPIRE) in one atomic step,
// so that of two parts finishing at the same moment exactly one sees the
// header complete. That part is marked the finisher (.f, onceler's own
// key), so that its redelivery, and only its, publishes the body again
// if it died before the chord was done.
// KEYS: .j .t .s .f; ARGV[1] entry, ARGV[2] score, ARGV[3] expiry seconds
// (0: none), ARGV[4] task id. Returns {0} or {1, entries in score order}.
var chordPartScript = redis.NewScript(`
local added = redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
local ready = redis.call('ZCOUNT', KEYS[1], '-inf', '+inf')
local diff = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
local size = redis.call('GET', KEYS[3])
local ttl = tonumber(ARGV[3])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
  redis.call('EXPIRE', KEYS[3], ttl)
end
if not size then
  return {0}
end
if ready ~= (tonumber(size) or -1) + diff then
  return {0}
end
local finisher = redis.call('GET', KEYS[4])
if added == 1 and not finisher then
  if ttl > 0 then
    redis.call('SETEX', KEYS[4], ttl, ARGV[4])
  else
    redis.call('SET', KEYS[4], ARGV[4])
  end
elseif finisher ~= ARGV[4] then
  return {0}
end
local out = {1}
for _, e in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  out[#out + 1] = e
end
return out
`)

func chordKeys(gid string) []string {
	k := GroupKeyPrefix + gid
	return []string{k + ".j", k + ".t", k + ".s", k + ".f"}
}

func (b *redisBackend) chordPart(ctx context.Context, gid, taskID string, index *int, entry []byte) (bool, [][]byte, error) {
	score := "+inf"
	if index != nil {
		score = strconv.Itoa(*index)
	}
	res, err := chordPartScript.Run(ctx, b.c, chordKeys(gid), entry, score, b.expires, taskID).Slice()
	if err != nil {
		return false, nil, fmt.Errorf("redis chord part of group %s: %w", clip.String(gid, maxLogField), err)
	}
	if len(res) == 0 || res[0] != int64(1) {
		return false, nil, nil
	}
	joined := make([][]byte, 0, len(res)-1)
	for _, e := range res[1:] {
		s, ok := e.(string)
		if !ok {
			return false, nil, fmt.Errorf("redis chord part of group %s: join entry of type %T", clip.String(gid, maxLogField), e)
		}
		joined = append(joined, []byte(s))
	}
	return true, joined, nil
}

func (b *redisBackend) chordDone(ctx context.Context, gid string) error {
	if err := b.c.Del(ctx, chordKeys(gid)...).Err(); err != nil {
		return fmt.Errorf("redis delete chord counters of group %s: %w", clip.String(gid, maxLogField), err)
	}
	return nil
}
