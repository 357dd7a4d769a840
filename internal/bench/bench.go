// Package bench is sandboxd-bench (`make bench`): one program that starts
// its own isolated localcloud and daemon, makes its own repositories and
// sandboxes, runs every scenario at each round-trip time (localcloud's
// injected one-way delay), and prints a table plus the same as JSON.
//
// Round trips per call come from localcloud's counters (exec requests and
// channel opens on the sandbox's agent, runs API requests), read before and
// after each scenario.
package bench

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// Options of one benchmark run.
type Options struct {
	Bin   string          // directory of sandboxd, nook, sandboxd-localcloud
	JSON  string          // where the JSON goes ("" for none)
	Quick bool            // fewer samples and smaller sizes (the smoke test)
	RTTs  []time.Duration // round-trip times to run at
	// RWXRTTs are the round-trip times of the RWX-path rows (default 0,
	// 20 and 100 ms).
	RWXRTTs []time.Duration
	// RWXCLI is the RWX CLI binary for baseline A ("" for the project's
	// own one-process-per-command steps).
	RWXCLI string
	Log    io.Writer // progress
	// Only names the scenario groups to run (Groups); empty runs them all.
	Only []string
	// Repeat runs the round-trip scenarios this many times (default 1),
	// each time adding its rows: a group measured again and again in one
	// setup, say to compare builds run after run.
	Repeat int
	// Files are the sizes of the synced repositories, in files (default
	// 200, 5000 and 50,000; quick: 200).
	Files []int
}

// Groups are the scenario groups, as -only names them: the round-trip
// ones, then those run once at the end.
func Groups() []string {
	return []string{"no-sync", "synced", "burst", "agent", "baseline-a", "baseline-b", "callers", "start", "silence", "rwx", "rss", "list", "ready"}
}

// Row is one line of the table.
type Row struct {
	Scenario string  `json:"scenario"`
	RTTms    int     `json:"rtt_ms"`
	N        int     `json:"n"`
	MedianMs float64 `json:"median_ms"`
	P95Ms    float64 `json:"p95_ms"`
	// Per call, from localcloud's counters; -1 when not counted.
	ExecsPerCall float64 `json:"exec_requests_per_call"`
	ChansPerCall float64 `json:"channel_opens_per_call"`
	APIPerCall   float64 `json:"api_requests_per_call"`
	// RTTs is the median in round trips (at a non-zero RTT).
	RTTs  float64            `json:"median_in_rtts,omitempty"`
	Extra map[string]float64 `json:"extra,omitempty"`
	Note  string             `json:"note,omitempty"`
}

// Ratio compares two rows of the same run.
type Ratio struct {
	Name  string  `json:"name"`
	RTTms int     `json:"rtt_ms"`
	Value float64 `json:"value"`
	Note  string  `json:"note,omitempty"`
}

// Result is the whole run, as written to the JSON file.
type Result struct {
	StartedAt time.Time `json:"started_at"`
	Quick     bool      `json:"quick"`
	Seconds   float64   `json:"seconds"`
	CPUs      int       `json:"cpus"`
	Rows      []Row     `json:"rows"`
	Ratios    []Ratio   `json:"ratios"`
	Notes     []string  `json:"notes,omitempty"`
}

// Main is the program: flags, run, print. It returns the exit code.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("sandboxd-bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	self, _ := os.Executable()
	bin := fs.String("bin", filepath.Dir(self), "directory holding sandboxd, nook and sandboxd-localcloud")
	jsonOut := fs.String("json", "", "write the results as JSON to this file, relative to the working directory (default: bench.json in the -bin directory; \"\" for none)")
	quick := fs.Bool("quick", os.Getenv("BENCH_QUICK") == "1", "quick mode: few samples, small sizes (default from BENCH_QUICK=1)")
	rtts := fs.String("rtt", "0,20ms", "round-trip times to run at, comma-separated")
	rwxRTTs := fs.String("rwx-rtt", "0,20ms,100ms", "round-trip times of the RWX-path rows, comma-separated")
	only := fs.String("only", "", "run only these scenario groups, comma-separated: "+strings.Join(Groups(), ", "))
	repeat := fs.Int("repeat", 1, "run the round-trip scenarios this many times")
	files := fs.String("files", "", "sizes of the synced repositories in files, comma-separated (default 200,5000,50000; quick: 200)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	// Absolute: the binaries are run from the repositories' directories.
	binDir, err := filepath.Abs(*bin)
	if err != nil {
		fmt.Fprintf(stderr, "sandboxd-bench: -bin %q: %v\n", *bin, err)
		return 2
	}
	jsonFile, err := jsonPath(fs, *jsonOut, binDir)
	if err != nil {
		fmt.Fprintf(stderr, "sandboxd-bench: -json %q: %v\n", *jsonOut, err)
		return 2
	}
	opts := Options{Bin: binDir, JSON: jsonFile, Quick: *quick, RWXCLI: os.Getenv("RWX_CLI"), Log: stderr, Repeat: *repeat}
	if *only != "" {
		for _, g := range strings.Split(*only, ",") {
			g = strings.TrimSpace(g)
			if !slices.Contains(Groups(), g) {
				fmt.Fprintf(stderr, "sandboxd-bench: -only %q: no such scenario group; the groups are %s\n", g, strings.Join(Groups(), ", "))
				return 2
			}
			opts.Only = append(opts.Only, g)
		}
	}
	if *files != "" {
		for _, f := range strings.Split(*files, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 1 {
				fmt.Fprintf(stderr, "sandboxd-bench: -files %q: want file counts such as 200,50000\n", *files)
				return 2
			}
			opts.Files = append(opts.Files, n)
		}
	}
	if *repeat < 1 {
		fmt.Fprintf(stderr, "sandboxd-bench: -repeat %d: want 1 or more\n", *repeat)
		return 2
	}
	for _, f := range []struct {
		name string
		val  string
		to   *[]time.Duration
	}{{"rtt", *rtts, &opts.RTTs}, {"rwx-rtt", *rwxRTTs, &opts.RWXRTTs}} {
		for _, s := range strings.Split(f.val, ",") {
			s = strings.TrimSpace(s)
			if s == "0" {
				*f.to = append(*f.to, 0)
				continue
			}
			d, err := time.ParseDuration(s)
			if err != nil || d < 0 || d%(2*time.Millisecond) != 0 {
				fmt.Fprintf(stderr, "sandboxd-bench: -%s %q: want durations in whole even milliseconds such as 0,20ms\n", f.name, s)
				return 2
			}
			*f.to = append(*f.to, d)
		}
	}
	for _, b := range []string{"sandboxd", "nook", "sandboxd-localcloud"} {
		if _, err := os.Stat(filepath.Join(opts.Bin, b)); err != nil {
			fmt.Fprintf(stderr, "sandboxd-bench: %s not found in %s: run `make build` or pass -bin\n", b, opts.Bin)
			return 2
		}
	}
	res, err := Run(ctx, opts)
	if err != nil {
		fmt.Fprintf(stderr, "sandboxd-bench: %v\n", err)
		return 1
	}
	Print(stdout, res)
	if opts.JSON != "" {
		b, _ := json.MarshalIndent(res, "", "  ")
		if err := os.WriteFile(opts.JSON, append(b, '\n'), 0o644); err != nil {
			fmt.Fprintf(stderr, "sandboxd-bench: write %s: %v\n", opts.JSON, err)
			return 1
		}
		fmt.Fprintf(stdout, "\nJSON: %s\n", opts.JSON)
	}
	return 0
}

// jsonPath is where the JSON results go, absolute: the -json flag's file
// when it was given ("" for none), else bench.json beside the binaries (as
// `make bench` writes it), never the working directory unasked.
func jsonPath(fs *flag.FlagSet, val, binDir string) (string, error) {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == "json" })
	switch {
	case !set:
		return filepath.Join(binDir, "bench.json"), nil
	case val == "":
		return "", nil
	}
	return filepath.Abs(val)
}

// Print writes the table, the ratios and the notes.
func Print(w io.Writer, res Result) {
	fmt.Fprintf(w, "sandboxd-bench: %d rows in %.0fs on %d CPUs (quick=%v)\n\n", len(res.Rows), res.Seconds, res.CPUs, res.Quick)
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "scenario\tRTT ms\tn\tmedian ms\tp95 ms\tin RTTs\texec req/call\tchan opens/call\tAPI req/call\textra\t")
	num := func(v float64) string {
		switch {
		case v < 0:
			return "-"
		case v == math.Trunc(v):
			return fmt.Sprintf("%.0f", v)
		}
		return fmt.Sprintf("%.2f", v)
	}
	for _, r := range res.Rows {
		in := "-"
		if r.RTTms > 0 {
			in = fmt.Sprintf("%.2f", r.RTTs)
		}
		var extra []string
		keys := make([]string, 0, len(r.Extra))
		for k := range r.Extra {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			extra = append(extra, fmt.Sprintf("%s=%s", k, num(r.Extra[k])))
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.2f\t%.2f\t%s\t%s\t%s\t%s\t%s\t\n", r.Scenario, r.RTTms, r.N, r.MedianMs, r.P95Ms, in,
			num(r.ExecsPerCall), num(r.ChansPerCall), num(r.APIPerCall), strings.Join(extra, " "))
	}
	tw.Flush()
	if len(res.Ratios) > 0 {
		fmt.Fprintln(w, "\nratios (same run):")
		tw = tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
		for _, r := range res.Ratios {
			fmt.Fprintf(tw, "  %s\t%d ms\t%.2f\t%s\n", r.Name, r.RTTms, r.Value, r.Note)
		}
		tw.Flush()
	}
	for _, n := range res.Notes {
		fmt.Fprintf(w, "note: %s\n", n)
	}
}

// stats are the median and 95th percentile of samples, in ms.
func stats(samples []time.Duration) (median, p95 float64) {
	if len(samples) == 0 {
		return 0, 0
	}
	s := slices.Clone(samples)
	slices.Sort(s)
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	i95 := int(math.Ceil(0.95*float64(len(s)))) - 1
	return ms(s[len(s)/2]), ms(s[max(i95, 0)])
}
