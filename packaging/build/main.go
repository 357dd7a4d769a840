// Command build makes sandboxd's packages — a .deb, an .rpm and a tarball —
// from the one definition in packaging/nfpm/nfpm.yaml, with nfpm used as a
// library. packaging/ is a Go module of its own (packaging/go.mod), so that
// nfpm and its dependencies stay out of the product's go.mod. `make package`
// runs it from packaging/ after building the binaries, the man pages and
// the completions:
//
//	cd packaging && go run ./build -version v1.2.3 -arch amd64 -out ../dist
package main

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strings"
	"time"

	"github.com/goreleaser/nfpm/v2"
	_ "github.com/goreleaser/nfpm/v2/deb" // registers the deb packager
	"github.com/goreleaser/nfpm/v2/files"
	_ "github.com/goreleaser/nfpm/v2/rpm" // registers the rpm packager
)

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "build:", err)
		os.Exit(1)
	}
}

// Options say what to package and where the inputs are.
type Options struct {
	Definition string   // packaging/nfpm/nfpm.yaml
	Version    string   // git describe output; made a valid package version
	Arch       string   // GOARCH of the binaries
	Bin        string   // the built binaries
	Share      string   // man/man1/*.1 and the completions, as under /usr/share
	Out        string   // where the packages go
	Formats    []string // deb, rpm, tar
	MTime      time.Time
	// Uncompressed builds the .deb without compression: the tests' form
	// (compression is slow under the race detector; docs/performance.md).
	Uncompressed bool
}

func run(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("build", flag.ContinueOnError)
	o := Options{}
	fs.StringVar(&o.Definition, "definition", "nfpm/nfpm.yaml", "the package definition")
	fs.StringVar(&o.Version, "version", "", "the version (git describe); required")
	fs.StringVar(&o.Arch, "arch", runtime.GOARCH, "the GOARCH the binaries were built for")
	fs.StringVar(&o.Bin, "bin", "../bin", "the directory of the built binaries")
	fs.StringVar(&o.Share, "share", "../bin/share", "the generated man pages and completions")
	fs.StringVar(&o.Out, "out", "../dist", "the output directory")
	formats := fs.String("formats", "deb,rpm,tar", "the formats to build")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.Version == "" {
		return fmt.Errorf("-version is required (make package passes git describe)")
	}
	o.Formats = strings.Split(*formats, ",")
	paths, err := Build(ctx, o)
	for _, p := range paths {
		fmt.Fprintln(stdout, p)
	}
	return err
}

// PackageVersion turns a git describe string into a version deb and rpm
// both accept and order sensibly: v1.2.3-4-gabc-dirty is 1.2.3+4+gabc+dirty,
// and a bare commit (no tag yet) is 0.0.0+git<commit>.
func PackageVersion(describe string) string {
	v := strings.TrimPrefix(describe, "v")
	bareCommit := regexp.MustCompile(`^[0-9a-f]{7,40}(-dirty)?$`).MatchString(v)
	v = regexp.MustCompile(`[^A-Za-z0-9.+~]+`).ReplaceAllString(v, "+")
	if v == "" || v[0] < '0' || v[0] > '9' || bareCommit {
		v = "0.0.0+git" + v
	}
	return v
}

// Build writes the packages and returns their paths.
func Build(ctx context.Context, o Options) ([]string, error) {
	if o.MTime.IsZero() {
		o.MTime = time.Now().UTC().Truncate(time.Second)
	}
	def, err := filepath.Abs(o.Definition)
	if err != nil {
		return nil, err
	}
	o.Definition = def
	stage, err := os.MkdirTemp("", "sandboxd-package")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(stage)
	if err := prepareStage(stage, o); err != nil {
		return nil, err
	}
	abs := func(p string) string {
		a, err := filepath.Abs(p)
		if err != nil {
			return p
		}
		return a
	}
	vars := map[string]string{
		"ARCH": o.Arch, "VERSION": PackageVersion(o.Version),
		"BIN": abs(o.Bin), "SHARE": abs(o.Share), "STAGE": stage, "ROOT": abs(repoRoot(o.Definition)),
	}
	if err := os.MkdirAll(o.Out, 0o755); err != nil {
		return nil, err
	}
	var out []string
	for _, format := range o.Formats {
		if err := ctx.Err(); err != nil {
			return out, err
		}
		cfg, err := nfpm.ParseFileWithEnvMapping(o.Definition, func(k string) string { return vars[k] })
		if err != nil {
			return out, fmt.Errorf("read %s: %w", o.Definition, err)
		}
		p, err := buildOne(cfg, format, o)
		if err != nil {
			return out, fmt.Errorf("build the %s package: %w", format, err)
		}
		out = append(out, p)
	}
	return out, nil
}

func buildOne(cfg nfpm.Config, format string, o Options) (string, error) {
	packager := format
	if format == "tar" {
		packager = "deb" // the tarball takes the overrides-free base definition
	}
	info, err := cfg.Get(packager)
	if err != nil {
		return "", err
	}
	info.MTime = o.MTime
	if o.Uncompressed {
		info.Deb.Compression = "none"
	}
	if s := info.Scripts.PostInstall; s != "" && !filepath.IsAbs(s) {
		info.Scripts.PostInstall = filepath.Join(repoRoot(o.Definition), s)
	}
	info = nfpm.WithDefaults(info)
	if format == "tar" {
		return writeTarball(info, o)
	}
	if err := nfpm.PrepareForPackager(info, format); err != nil {
		return "", err
	}
	p, err := nfpm.Get(format)
	if err != nil {
		return "", err
	}
	path := filepath.Join(o.Out, p.ConventionalFileName(info))
	f, err := os.Create(path)
	if err != nil {
		return "", err
	}
	if err := p.Package(info, f); err != nil {
		f.Close()
		os.Remove(path)
		return "", err
	}
	return path, f.Close()
}

// writeTarball writes the package's files (as the deb lays them out under
// /usr) into sandboxd-VERSION-linux-ARCH.tar.gz, under one top directory:
// `tar -C /usr/local --strip-components=2 -xzf ...` installs it.
func writeTarball(info *nfpm.Info, o Options) (string, error) {
	contents, err := files.PrepareForPackager(info.Contents, info.Umask, "tar", info.DisableGlobbing, info.MTime)
	if err != nil {
		return "", err
	}
	top := fmt.Sprintf("sandboxd-%s-linux-%s", info.Version, info.Arch)
	path := filepath.Join(o.Out, top+".tar.gz")
	f, err := os.Create(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	gz := gzip.NewWriter(f)
	tw := tar.NewWriter(gz)
	sort.Slice(contents, func(i, j int) bool { return contents[i].Destination < contents[j].Destination })
	for _, c := range contents {
		if c.Type == files.TypeDir || c.Type == files.TypeImplicitDir || c.Source == "" {
			continue
		}
		if err := addFile(tw, c.Source, top+c.Destination, c.FileInfo.Mode.Perm(), o.MTime); err != nil {
			return "", err
		}
	}
	if err := tw.Close(); err != nil {
		return "", err
	}
	if err := gz.Close(); err != nil {
		return "", err
	}
	return path, f.Close()
}

func addFile(tw *tar.Writer, src, name string, mode os.FileMode, mtime time.Time) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	if err := tw.WriteHeader(&tar.Header{Name: name, Mode: int64(mode), Size: int64(len(b)), ModTime: mtime, Typeflag: tar.TypeReg, Uname: "root", Gname: "root"}); err != nil {
		return err
	}
	_, err = tw.Write(b)
	return err
}

// prepareStage writes what the definition takes from ${STAGE}: the man
// pages gzipped (as Debian policy wants them) and the systemd user units
// pointing at /usr/bin/sandboxd.
func prepareStage(stage string, o Options) error {
	for _, page := range []string{"nook.1", "sandboxd.1"} {
		b, err := os.ReadFile(filepath.Join(o.Share, "man", "man1", page))
		if err != nil {
			return fmt.Errorf("read the generated man page (run `make man` first): %w", err)
		}
		f, err := os.Create(filepath.Join(stage, page+".gz"))
		if err != nil {
			return err
		}
		gz, _ := gzip.NewWriterLevel(f, gzip.BestCompression)
		gz.ModTime = o.MTime
		if _, err := gz.Write(b); err != nil {
			f.Close()
			return err
		}
		if err := gz.Close(); err != nil {
			f.Close()
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
	}
	root := repoRoot(o.Definition)
	for _, unit := range []string{"sandboxd.service", "sandboxd.socket"} {
		b, err := os.ReadFile(filepath.Join(root, "packaging", "systemd", unit))
		if err != nil {
			return err
		}
		s := regexp.MustCompile(`(?m)^ExecStart=.*$`).ReplaceAllString(string(b), "ExecStart=/usr/bin/sandboxd")
		if err := os.WriteFile(filepath.Join(stage, unit), []byte(s), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// repoRoot is the repository holding the definition
// (packaging/nfpm/nfpm.yaml).
func repoRoot(definition string) string {
	return filepath.Dir(filepath.Dir(filepath.Dir(definition)))
}
