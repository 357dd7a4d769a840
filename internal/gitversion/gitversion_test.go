package gitversion

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestNeedKnowsTheFixedReleases(t *testing.T) {
	for out, unsafe := range map[string]bool{
		"git version 2.39.2":                   true,
		"git version 2.39.3 (Apple Git-145)":   false,
		"git version 2.39.5":                   false,
		"git version 2.40.0":                   true,
		"git version 2.40.1":                   false,
		"git version 2.41.0":                   false,
		"git version 2.45.1.windows.1":         false,
		"git version 2.30.8":                   true,
		"git version 2.30.9":                   false,
		"git version 2.25.1":                   true,
		"git version 1.8.3.1":                  true,
		"git version 3.0.0":                    false,
		"git version 2.38.4\nsomething else\n": true,
	} {
		v, err := Parse(out)
		if err != nil {
			t.Fatalf("%q: %v", out, err)
		}
		if got, need := Need(v); got != unsafe {
			t.Errorf("%q: unsafe %v (need %q), want %v", out, got, need, unsafe)
		}
	}
	if _, err := Parse("not git"); err == nil {
		t.Fatal("an answer that is not git's was read")
	}
}

// Check runs the binary it is given and says which version to install.
func TestCheckRefusesAnOldGitSayingWhatToInstall(t *testing.T) {
	dir := t.TempDir()
	fake := filepath.Join(dir, "git")
	if err := os.WriteFile(fake, []byte("#!/bin/sh\necho 'git version 2.39.2'\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	_, err := Check(context.Background(), fake)
	if !errors.Is(err, ErrUnsafe) || !strings.Contains(err.Error(), "install git 2.39.3") {
		t.Fatalf("git 2.39.2: %v", err)
	}
	if _, err := Check(context.Background(), filepath.Join(dir, "missing")); err == nil || errors.Is(err, ErrUnsafe) {
		t.Fatalf("a missing git: %v", err)
	}
}
