package repocheck

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

var (
	namedTest = regexp.MustCompile("`((?:Test|Fuzz|Benchmark)[A-Za-z0-9_]*)(\\*?)[^`]*`")
	testFunc  = regexp.MustCompile(`(?m)^func ((?:Test|Fuzz|Benchmark)[A-Za-z0-9_]*)\(`)
)

// TestGuaranteesNameTestsThatExist: every test the guarantee table names
// (docs/guarantees.md; `TestX*` names a family, `TestX/case` a subtest of
// TestX) is a test of the tree, so a renamed or deleted test cannot leave
// a guarantee that nothing proves.
func TestGuaranteesNameTestsThatExist(t *testing.T) {
	root := repoRoot(t)
	var funcs []string
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "bin" || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(p, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		for _, m := range testFunc.FindAllStringSubmatch(string(b), -1) {
			funcs = append(funcs, m[1])
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, "docs", "guarantees.md"))
	if err != nil {
		t.Fatal(err)
	}
	named := 0
	for _, m := range namedTest.FindAllStringSubmatch(string(b), -1) {
		name, family := m[1], m[2] == "*"
		named++
		found := slices.ContainsFunc(funcs, func(f string) bool {
			return f == name || family && strings.HasPrefix(f, name)
		})
		if !found {
			t.Errorf("docs/guarantees.md names %s, which is no test of the tree: say which test proves that guarantee now", m[0])
		}
	}
	if named < 100 {
		t.Errorf("docs/guarantees.md names %d tests; the table was not read", named)
	}
}
