// Package logging makes the zap loggers of the onceler command and the
// default logger of tasks.Config: one format for people, one for machines.
package logging

import (
	"fmt"
	"io"
	"os"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// New returns a logger writing to w at lvl and above, in format "console"
// (for people: time, level, logger name, message, fields; levels in color
// on a terminal) or "json" (one object a line, ISO 8601 times).
func New(lvl zapcore.Level, format string, w io.Writer) (*zap.Logger, error) {
	var enc zapcore.Encoder
	switch format {
	case "json":
		ec := zap.NewProductionEncoderConfig()
		ec.EncodeTime = zapcore.ISO8601TimeEncoder
		enc = zapcore.NewJSONEncoder(ec)
	case "console":
		ec := zap.NewDevelopmentEncoderConfig()
		ec.EncodeTime = zapcore.TimeEncoderOfLayout("15:04:05.000")
		ec.CallerKey = ""
		ec.EncodeLevel = zapcore.CapitalLevelEncoder
		if f, ok := w.(*os.File); ok && isTerminal(f) {
			ec.EncodeLevel = zapcore.CapitalColorLevelEncoder
		}
		enc = zapcore.NewConsoleEncoder(ec)
	default:
		return nil, fmt.Errorf("unknown log format %q: use json or console", format)
	}
	return zap.New(zapcore.NewCore(enc, zapcore.Lock(zapcore.AddSync(w)), lvl)), nil
}

// Default is the logger of a worker given none: info and above to standard
// error, in the console format, as the onceler command logs by default.
func Default() *zap.Logger {
	l, _ := New(zapcore.InfoLevel, "console", os.Stderr)
	return l
}

func isTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
