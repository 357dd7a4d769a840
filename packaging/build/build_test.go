package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/xml"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

func TestPackageVersion(t *testing.T) {
	for in, want := range map[string]string{
		"v1.2.3":                  "1.2.3",
		"v1.2.3-4-gabcdef0":       "1.2.3+4+gabcdef0",
		"v1.2.3-4-gabcdef0-dirty": "1.2.3+4+gabcdef0+dirty",
		"24d4616":                 "0.0.0+git24d4616",
		"24d4616-dirty":           "0.0.0+git24d4616+dirty",
		"dev":                     "0.0.0+gitdev",
	} {
		if got := PackageVersion(in); got != want {
			t.Errorf("PackageVersion(%q) = %q, want %q", in, got, want)
		}
	}
}

// must runs a command and fails the test unless it succeeds.
func must(t *testing.T, env []string, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	if env != nil {
		cmd.Env = env
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestDebInstallsRunsAndRemoves builds the .deb from the real binaries,
// checks its metadata and contents with dpkg-deb, installs it into a
// throwaway root with dpkg, runs the installed nook version (which starts the
// installed sandboxd), and removes it, leaving nothing behind. The
// postinst starts nothing: a systemctl on PATH that records its calls is
// never called.
func TestDebInstallsRunsAndRemoves(t *testing.T) {
	for _, tool := range []string{"dpkg", "dpkg-deb"} {
		needTool(t, tool, "apt-get install dpkg")
	}
	tmp := t.TempDir()
	bin, share := filepath.Join(tmp, "bin"), filepath.Join(tmp, "share")
	// The commands are the root module's (packaging/ is a module of its own).
	must(t, nil, "go", "-C", "../..", "build", "-trimpath", "-ldflags", "-X main.Version=v9.8.7", "-o", bin+"/",
		"./cmd/nook", "./cmd/nook/nook-mcp", "./cmd/sandboxd", "./cmd/sandboxd-localcloud", "./cmd/sandboxd-helper")
	gen := func(rel string, name string, args ...string) {
		path := filepath.Join(share, rel)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(must(t, nil, filepath.Join(bin, name), args...)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	gen("man/man1/nook.1", "nook", "man")
	gen("man/man1/sandboxd.1", "sandboxd", "--man")
	gen("bash-completion/completions/nook", "nook", "completion", "bash")
	gen("zsh/site-functions/_nook", "nook", "completion", "zsh")
	gen("fish/vendor_completions.d/nook.fish", "nook", "completion", "fish")

	t.Run("make install", func(t *testing.T) { testMakeInstall(t, bin, share) })

	out := filepath.Join(tmp, "dist")
	// The .rpm and the tarball come from the same definition; building them
	// (compressed) is the long form of this test.
	formats := []string{"deb"}
	if os.Getenv("SANDBOXD_TEST_LONG") != "" {
		formats = append(formats, "rpm", "tar")
	}
	paths, err := Build(context.Background(), Options{
		Definition: "../nfpm/nfpm.yaml", Version: "v9.8.7", Arch: "amd64",
		Bin: bin, Share: share, Out: out, Formats: formats, Uncompressed: len(formats) == 1,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(paths) != len(formats) || !strings.HasSuffix(paths[0], "sandboxd_9.8.7_amd64.deb") {
		t.Fatalf("packages %v", paths)
	}
	deb := paths[0]

	info := must(t, nil, "dpkg-deb", "-I", deb)
	for _, want := range []string{"Package: sandboxd", "Version: 9.8.7", "Architecture: amd64", "postinst"} {
		if !strings.Contains(info, want) {
			t.Errorf("dpkg-deb -I lacks %q:\n%s", want, info)
		}
	}
	// The local remote, the default, runs sandboxes under bubblewrap and
	// gives them the internet with pasta.
	recommends := must(t, nil, "dpkg-deb", "-f", deb, "Recommends")
	for _, want := range []string{"bubblewrap", "passt"} {
		if !strings.Contains(recommends, want) {
			t.Errorf("the .deb does not recommend %s: Recommends: %s", want, recommends)
		}
	}
	list := must(t, nil, "dpkg-deb", "-c", deb)
	for _, want := range []string{
		"./usr/bin/nook", "./usr/bin/nook-mcp", "./usr/bin/sandboxd", "./usr/bin/sandboxd-localcloud", "./usr/bin/sandboxd-helper",
		"./usr/lib/systemd/user/sandboxd.service", "./usr/lib/systemd/user/sandboxd.socket",
		"./usr/share/bash-completion/completions/nook", "./usr/share/zsh/vendor-completions/_nook",
		"./usr/share/fish/vendor_completions.d/nook.fish",
		"./usr/share/man/man1/nook.1.gz", "./usr/share/man/man1/sandboxd.1.gz",
		"./usr/share/doc/sandboxd/copyright", "./usr/share/doc/sandboxd/README.md", "./usr/share/doc/sandboxd/json.md",
	} {
		if !strings.Contains(list, want+"\n") {
			t.Errorf("dpkg-deb -c lacks %s:\n%s", want, list)
		}
	}
	unit := must(t, nil, "dpkg-deb", "--fsys-tarfile", deb)
	if !strings.Contains(unit, "ExecStart=/usr/bin/sandboxd") {
		t.Error("the packaged sandboxd.service does not start /usr/bin/sandboxd")
	}

	// Install into a throwaway root. A systemctl that records its calls is
	// first on PATH: the postinst must not call it.
	root := filepath.Join(tmp, "root")
	admin := filepath.Join(root, "var", "lib", "dpkg")
	for _, d := range []string{filepath.Join(admin, "info"), filepath.Join(admin, "updates"), filepath.Join(root, "usr", "bin")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(admin, "status"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	fake := filepath.Join(tmp, "fakebin")
	calls := filepath.Join(tmp, "systemctl-calls")
	os.MkdirAll(fake, 0o755)
	os.WriteFile(filepath.Join(fake, "systemctl"), []byte("#!/bin/sh\necho \"$@\" >> "+calls+"\n"), 0o755)
	dpkgEnv := append(os.Environ(), "PATH="+fake+":"+os.Getenv("PATH"))
	dpkg := func(args ...string) string {
		return must(t, dpkgEnv, "dpkg", append([]string{"--root=" + root, "--force-not-root", "--force-script-chrootless", "--log=/dev/null"}, args...)...)
	}
	installOut := dpkg("-i", deb)
	if !strings.Contains(installOut, "systemctl --user enable") {
		t.Errorf("the postinst does not say how to enable the user units:\n%s", installOut)
	}
	if b, err := os.ReadFile(calls); err == nil {
		t.Errorf("the postinst ran systemctl %s", b)
	}

	// The installed nook starts the installed sandboxd and reports both.
	home := filepath.Join(tmp, "home")
	env := []string{"HOME=" + home, "PATH=/usr/bin:/bin",
		"XDG_RUNTIME_DIR=" + filepath.Join(home, "run"), "XDG_STATE_HOME=" + filepath.Join(home, "state"),
		"XDG_CONFIG_HOME=" + filepath.Join(home, "config"), "XDG_DATA_HOME=" + filepath.Join(home, "data")}
	os.MkdirAll(filepath.Join(home, "run"), 0o700)
	nook := filepath.Join(root, "usr", "bin", "nook")
	t.Cleanup(func() {
		cmd := exec.Command(nook, "daemon", "stop")
		cmd.Env = env
		_ = cmd.Run()
	})
	v := must(t, env, nook, "version")
	if !strings.Contains(v, "nook       v9.8.7") || !strings.Contains(v, "sandboxd  v9.8.7") {
		t.Fatalf("installed nook version:\n%s", v)
	}
	must(t, env, nook, "daemon", "stop")
	// The installed nook mcp is the nook-mcp installed next to it: it answers
	// an MCP initialize request (and ends with its input).
	cmd := exec.Command(nook, "mcp")
	cmd.Env = env
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	mcpOut, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	io.WriteString(in, `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"deb-test","version":"1"}}}`+"\n")
	line, _ := bufio.NewReader(mcpOut).ReadString('\n')
	in.Close()
	if err := cmd.Wait(); err != nil || !strings.Contains(line, `"serverInfo"`) {
		t.Fatalf("installed nook mcp: %v\n%s%s", err, line, stderr.String())
	}

	// Removal leaves no file of the package.
	dpkg("--purge", "sandboxd")
	var left []string
	filepath.Walk(filepath.Join(root, "usr"), func(p string, fi os.FileInfo, err error) error {
		if err == nil && !fi.IsDir() {
			left = append(left, p)
		}
		return nil
	})
	if len(left) > 0 {
		t.Fatalf("files left after purge: %v", left)
	}
	status, _ := os.ReadFile(filepath.Join(admin, "status"))
	if bytes.Contains(status, []byte("Package: sandboxd")) && !bytes.Contains(status, []byte("not-installed")) {
		t.Fatalf("dpkg still lists sandboxd:\n%s", status)
	}
}

// The launchd agent is a well-formed property list that starts sandboxd at
// login and restarts it only when it fails, like sandboxd.service.
func TestLaunchdAgent(t *testing.T) {
	b, err := os.ReadFile("../launchd/com.github.sandboxd.sandboxd.plist")
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Dict struct {
			Inner []byte `xml:",innerxml"`
		} `xml:"dict"`
	}
	if err := xml.Unmarshal(b, &doc); err != nil {
		t.Fatalf("the plist is not well-formed XML: %v", err)
	}
	s := string(b)
	for _, want := range []string{
		"<key>Label</key>\n  <string>com.github.sandboxd.sandboxd</string>",
		"<key>ProgramArguments</key>\n  <array>\n    <string>@SANDBOXD@</string>",
		"<key>RunAtLoad</key>\n  <true/>",
		"<key>SuccessfulExit</key>\n    <false/>",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("the launchd agent lacks %q", want)
		}
	}
}

// The docs name only files that are in the repository (they once pointed to
// a DESIGN.md that was not).
func TestDocsNameOnlyFilesInTheRepository(t *testing.T) {
	root := "../.."
	have := map[string]bool{}
	var docs []string
	filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() && (d.Name() == ".git" || d.Name() == "bin" || d.Name() == "dist") {
			return filepath.SkipDir
		}
		rel, _ := filepath.Rel(root, p)
		have[rel], have[d.Name()] = true, true
		if strings.HasSuffix(p, ".md") || strings.HasSuffix(p, ".go") && !strings.HasSuffix(p, "_test.go") {
			docs = append(docs, p)
		}
		return nil
	})
	mention := regexp.MustCompile(`[A-Za-z0-9_./-]+\.md\b`)
	for _, p := range docs {
		b, _ := os.ReadFile(p)
		for _, m := range mention.FindAllString(string(b), -1) {
			name := strings.TrimPrefix(m, "./")
			if !have[name] && !have[filepath.Base(name)] {
				t.Errorf("%s names %s, which is not in the repository", p, m)
			}
		}
	}
}

// testMakeInstall runs make install's recipe (not its build prerequisites:
// the binaries and generated files are given): the completions and man
// pages are installed, and the systemctl advice is printed only when the
// units go to a directory systemd reads.
func testMakeInstall(t *testing.T, bin, share string) {
	needTool(t, "make", "apt-get install make")
	home := t.TempDir()
	install := func(unitDir string) string {
		cmd := exec.Command("make", "-s", "-C", "../..", "-o", "build", "-o", "man", "-o", "completions", "install",
			"HOME="+home, "BIN="+bin, "SHARE="+share, "PREFIX="+filepath.Join(home, ".local"), "SYSTEMD_USER_DIR="+unitDir, "UNAME_S=Linux")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("make install: %v\n%s", err, out)
		}
		return string(out)
	}
	out := install(filepath.Join(home, ".config", "systemd", "user"))
	if !strings.Contains(out, "systemctl --user enable") {
		t.Errorf("no systemctl advice for ~/.config/systemd/user:\n%s", out)
	}
	for _, f := range []string{"bin/nook", "bin/nook-mcp", "share/man/man1/nook.1", "share/man/man1/sandboxd.1", "share/bash-completion/completions/nook",
		"share/zsh/site-functions/_nook", "share/fish/vendor_completions.d/nook.fish"} {
		if _, err := os.Stat(filepath.Join(home, ".local", f)); err != nil {
			t.Errorf("make install did not install %s: %v", f, err)
		}
	}
	out = install(filepath.Join(home, "units"))
	if strings.Contains(out, "systemctl --user enable") || !strings.Contains(out, "which systemd does not read") {
		t.Errorf("systemctl advice for a directory systemd does not read:\n%s", out)
	}
}

// needTool returns the path of a program the test drives, or skips the test
// saying how to get it; under CI (whose set-up installs it) it fails. The
// packaging module has its own go.mod, so it does not share the product's
// internal/testutil.
func needTool(t *testing.T, name, install string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err == nil {
		return p
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s is not installed (%s; .ci/run installs it), and CI=true: the test set-up must provide it", name, install)
	}
	t.Skipf("%s is not installed (%s)", name, install)
	return ""
}
