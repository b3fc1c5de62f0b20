package replay

import (
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"
)

// Process is a child process whose standard output and error go to a log
// file: a worker process of the suite, or of a test's own harness.
type Process struct {
	// Name names it in messages (a worker's node name).
	Name string
	// LogPath is the file that holds its stderr and stdout.
	LogPath string

	cmd  *exec.Cmd
	done chan struct{}
}

// StartProcess starts cmd with its standard output and error appended to
// a new file at logPath.
func StartProcess(cmd *exec.Cmd, name, logPath string) (*Process, error) {
	log, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("log of %s: %w", name, err)
	}
	defer log.Close()
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &Process{Name: name, LogPath: logPath, cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// Exited reports whether the process has ended.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// WaitExit waits until the process ends and reports whether it did within
// timeout.
func (p *Process) WaitExit(timeout time.Duration) bool {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-p.done:
		return true
	case <-t.C:
		return false
	}
}

// Signal sends sig to the process (SIGSTOP, SIGCONT, ...).
func (p *Process) Signal(sig syscall.Signal) error {
	if p.Exited() {
		return fmt.Errorf("process %s has exited", p.Name)
	}
	if err := p.cmd.Process.Signal(sig); err != nil {
		return fmt.Errorf("signal process %s: %w", p.Name, err)
	}
	return nil
}

// PID is the process id.
func (p *Process) PID() int { return p.cmd.Process.Pid }

// Kill ends the process with SIGKILL (after SIGCONT, should it be stopped)
// and waits for it.
func (p *Process) Kill() {
	if p.Exited() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	_ = p.cmd.Process.Signal(syscall.SIGCONT)
	<-p.done
}

// Terminate asks the process to stop (SIGTERM, after SIGCONT) and reports
// whether it ended within timeout; it is not killed.
func (p *Process) Terminate(timeout time.Duration) bool {
	if p.Exited() {
		return true
	}
	_ = p.cmd.Process.Signal(syscall.SIGCONT)
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	return p.WaitExit(timeout)
}

// State describes how the process ended, or "running".
func (p *Process) State() string {
	if !p.Exited() {
		return "running"
	}
	return p.cmd.ProcessState.String()
}

// Succeeded reports whether the process ended with exit status 0.
func (p *Process) Succeeded() bool {
	return p.Exited() && p.cmd.ProcessState.Success()
}

// Crashed reports whether the process ended by SIGKILL (crash injection or
// Kill).
func (p *Process) Crashed() bool {
	if !p.Exited() {
		return false
	}
	ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// Log returns everything the process wrote so far.
func (p *Process) Log() string {
	b, err := os.ReadFile(p.LogPath)
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	return string(b)
}

// LogTail returns the last n bytes of the log.
func (p *Process) LogTail(n int) string {
	s := p.Log()
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}
