//go:build linux

package gitsync

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sandboxd/sandboxd/internal/helperproto"
)

// The sandbox side is picked once per exec: the helper's one exchange when
// a helper of this protocol serves on the connection; the shell's separate
// steps when none does, or when the one there speaks another version (it
// takes nothing, and nothing runs twice). Each path leaves both sides
// synced.
func TestEachSandboxSideIsTakenWhenItShould(t *testing.T) {
	ctx := context.Background()
	const command = "cat a.txt; echo ran >> ran.txt"
	// fuse prepares and offers the exec to the side r's exec picks.
	fuse := func(t *testing.T, f *fixture) (*Exchange, bool) {
		t.Helper()
		writeFile(t, filepath.Join(f.local, "a.txt"), "local\n")
		p, err := f.s.Prepare(ctx, f.local, f.base)
		if err != nil {
			t.Fatal(err)
		}
		p.Sandbox = "fixture"
		f.r.reset()
		x, ok, err := f.s.Fuse(ctx, f.r, p, command)
		if err != nil {
			t.Fatalf("fuse: %v", err)
		}
		return x, ok
	}
	synced := func(t *testing.T, f *fixture, out string) {
		t.Helper()
		if out != "local\n" {
			t.Fatalf("the command saw %q", out)
		}
		if got := string(fileBytes(t, filepath.Join(f.local, "ran.txt"))); got != "ran\n" {
			t.Fatalf("the command's edit came back as %q (it ran more than once, or not at all)", got)
		}
	}

	t.Run("helper absent", func(t *testing.T) {
		f := newFixture(t, map[string]string{"a.txt": "a\n"})
		if k := sideOf(f.r).kind(); k != "shell" {
			t.Fatalf("without a helper the side is %q", k)
		}
		if _, ok := fuse(t, f); ok || f.r.calls() != 0 {
			t.Fatalf("without a helper the exec was fused (%v, %d runner calls)", ok, f.r.calls())
		}
		out, fr, err := f.split(command)
		if err != nil || !fr.Ran {
			t.Fatalf("separate steps: ran %v, err %v", fr.Ran, err)
		}
		synced(t, f, out)
	})

	t.Run("helper present", func(t *testing.T) {
		useHelper = true
		t.Cleanup(func() { useHelper = false })
		f := newFixture(t, map[string]string{"a.txt": "a\n"})
		if k := sideOf(f.r).kind(); k != "helper" {
			t.Fatalf("with a helper the side is %q", k)
		}
		x, ok := fuse(t, f)
		if !ok || !strings.Contains(x.Command(), `/bin/`+f.r.helperName+`" exchange`) {
			t.Fatalf("with a helper the exec was not one exchange (%v)", ok)
		}
		var stdout bytes.Buffer
		if err := x.Run(ctx, f.r, ExchangeIO{Stdout: &stdout}); err != nil {
			t.Fatal(err)
		}
		fr, err := x.Finish(ctx, f.r)
		if err != nil || !fr.Ran || fr.Split || fr.Again {
			t.Fatalf("exchange: ran %v split %v again %v, err %v", fr.Ran, fr.Split, fr.Again, err)
		}
		if n := f.r.calls(); n != 1 {
			t.Fatalf("the exchange made %d runner calls, want 1", n)
		}
		synced(t, f, stdout.String())
	})

	t.Run("helper of another version", func(t *testing.T) {
		useHelper = true
		t.Cleanup(func() { useHelper = false })
		f := newFixture(t, map[string]string{"a.txt": "a\n"})
		// The installed helper answers the hello with a version this
		// daemon does not speak, as one of another build would, and goes
		// on in its own: what follows is not read.
		bin := filepath.Join(f.sandbox, ".git", "sandboxd", "bin")
		answer := filepath.Join(t.TempDir(), "hello")
		writeFile(t, filepath.Join(bin, "other"), "#!/bin/sh\ncat "+answer+"\n")
		if err := os.Chmod(filepath.Join(bin, "other"), 0o755); err != nil {
			t.Fatal(err)
		}
		// A rename: the running server's file is busy.
		if err := os.Rename(filepath.Join(bin, "other"), filepath.Join(bin, f.r.helperName)); err != nil {
			t.Fatal(err)
		}
		x, ok := fuse(t, f)
		if !ok {
			t.Fatal("the exec was not offered to the helper")
		}
		var hello bytes.Buffer
		// Tagged with this exchange's key: a frame without its tag would
		// be refused as forged before its version is read.
		fw := &helperproto.FrameWriter{W: &hello, Key: x.key}
		for _, f := range []struct {
			typ byte
			v   any
		}{
			{helperproto.FrameHelloAnswer, helperproto.HelloAnswer{Version: helperproto.Version + 1}},
			{helperproto.FrameStarted, helperproto.Started{}},
			{helperproto.FrameExit, helperproto.Exit{}},
			{helperproto.FramePullEnd, helperproto.PullEnd{}},
		} {
			if err := fw.JSON(f.typ, f.v); err != nil {
				t.Fatal(err)
			}
		}
		if err := fw.Write(helperproto.FrameEnd, nil); err != nil {
			t.Fatal(err)
		}
		writeFile(t, answer, hello.String())
		runCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		var stdout bytes.Buffer
		_ = x.Run(runCtx, f.r, ExchangeIO{Stdout: &stdout})
		fr, err := x.Finish(ctx, f.r)
		if err != nil || !fr.Split || fr.Ran || stdout.Len() != 0 {
			t.Fatalf("another version: split %v ran %v output %q, err %v", fr.Split, fr.Ran, stdout.String(), err)
		}
		if _, err := os.Lstat(filepath.Join(f.sandbox, "ran.txt")); !os.IsNotExist(err) {
			t.Fatalf("the command ran in the exchange of another version: %v", err)
		}
		out, fr, err := f.split(command)
		if err != nil || !fr.Ran {
			t.Fatalf("separate steps: ran %v, err %v", fr.Ran, err)
		}
		synced(t, f, out)
	})
}

// The scripts, the shell's separate steps and the helper's fallbacks
// alike, never call the helper: it hands them what it found, and an exit
// status is only ever the step's own.
func TestScriptsNeverCallTheHelper(t *testing.T) {
	acks := []string{"0123456789abcdef"}
	now := time.Unix(1700000000, 0)
	head := strings.Repeat("ab", 20)
	scripts := map[string]string{
		"push":  pushScript(head, "k", now, "fedcba9876543210", acks, 1<<20, false),
		"pull":  pullScript(acks, 1<<20),
		"fetch": fetchScript("0123456789abcdef"),
	}
	h := helperSide{name: helperproto.Name + "-0123456789abcdef", inst: "0123456789abcdef"}
	remote, req, ok := h.exchange(exchangeInput{p: &Patch{HeadSHA: head, Data: []byte("x")}, pend: "fedcba9876543210", acks: acks, now: now, max: 1 << 20}, "true")
	if !ok {
		t.Fatal("the helper side took no exchange")
	}
	scripts["exchange stray"], scripts["exchange push"], scripts["exchange pull"] = req.StrayScript, req.PushScript, req.PullScript
	for name, s := range scripts {
		for _, call := range []string{`"$H"`, "$HI", "/bin/", helperproto.Name, " 75", " 76"} {
			if strings.Contains(s, call) {
				t.Errorf("the %s script holds %q", name, call)
			}
		}
	}
	// The exchange's own command calls the helper once, to become it.
	if n := strings.Count(remote, "/bin/"); n != 1 || !strings.Contains(remote, `exec "$st/bin/`+h.name+`" exchange`) {
		t.Errorf("the exchange's command is %q", remote)
	}
}
