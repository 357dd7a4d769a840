package gitsync

import (
	"slices"
	"strings"
	"testing"
)

// FuzzNumstatFiles: the list of files a pulled patch changes is parsed from
// `git apply --numstat -z` of a patch the sandbox made (not trusted). Any
// output gives a sorted list of non-empty names, each one a NUL-separated
// field of the output, never a panic.
func FuzzNumstatFiles(f *testing.F) {
	for _, s := range []string{
		"-\t-\tbin.dat\x001\t0\tnew.txt\x000\t1\tsp ace.txt\x001\t0\t\xc3\xbcn\xc3\xaf\nnl\x00", // real git output
		"1\t1\t\x00old name\x00new name\x00",                                                    // a rename
		"1\t1\t\x00only-old\x00",                                                                // a truncated rename
		"1\t1\t\x00\x00\x00",                                                                    // a rename of empty names
		"no tabs here\x00\t\t\x00\t\tx\ty\x00",                                                  // junk
		"",
		"\x00\x00\x00",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, out []byte) {
		files := numstatFiles(out)
		if !slices.IsSorted(files) {
			t.Fatalf("not sorted: %q", files)
		}
		fields := map[string]bool{}
		for _, fl := range splitZ(out) {
			fields[fl] = true
			if parts := strings.SplitN(fl, "\t", 3); len(parts) == 3 {
				fields[parts[2]] = true
			}
		}
		for _, name := range files {
			if name == "" {
				t.Fatalf("an empty file name from %q", out)
			}
			if !fields[name] {
				t.Fatalf("%q is not a field of the output %q", name, out)
			}
		}
	})
}
