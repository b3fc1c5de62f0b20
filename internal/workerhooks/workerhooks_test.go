package workerhooks

import "testing"

func TestCrashFromEnv(t *testing.T) {
	env := map[string]string{"ONCELER_CRASH_AT": "after_effect", "ONCELER_CRASH_TASK": "demo.pay"}
	c := CrashFromEnv(func(k string) string { return env[k] })
	if c.At != AfterEffect || c.Task != "demo.pay" || c.Validate() != nil {
		t.Fatalf("CrashFromEnv = %+v", c)
	}
	if (Crash{At: "sometime"}).Validate() == nil {
		t.Fatal("unknown crash point accepted")
	}
}
