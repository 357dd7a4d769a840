package bench

import (
	"bytes"
	"context"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Without -json the results go to bench.json in the -bin directory, not
// the working directory; a relative -json is taken from the working
// directory and made absolute; -json "" writes none. -help says so.
func TestJSONResultsGoBesideTheBinariesUnlessToldOtherwise(t *testing.T) {
	bin := t.TempDir()
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, filepath.Join(bin, "bench.json")},
		{[]string{"-json", "out/b.json"}, filepath.Join(wd, "out", "b.json")},
		{[]string{"-json", "/tmp/b.json"}, "/tmp/b.json"},
		{[]string{"-json", ""}, ""},
	} {
		fs := flag.NewFlagSet("sandboxd-bench", flag.ContinueOnError)
		v := fs.String("json", "", "")
		if err := fs.Parse(c.args); err != nil {
			t.Fatal(err)
		}
		if got, err := jsonPath(fs, *v, bin); err != nil || got != c.want {
			t.Errorf("%q: %q %v, want %q", c.args, got, err, c.want)
		}
	}
	var stderr bytes.Buffer
	if code := Main(context.Background(), []string{"-help"}, &bytes.Buffer{}, &stderr); code != 2 {
		t.Fatalf("-help: exit %d", code)
	}
	if !strings.Contains(stderr.String(), "default: bench.json in the -bin directory") {
		t.Errorf("-help does not say where the JSON goes:\n%s", stderr.String())
	}
}
