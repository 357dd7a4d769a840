# sandboxd — build, run, test, install. `make help` lists the targets.

SHELL := /bin/bash
export PATH := /usr/local/go/bin:$(PATH)

GO        ?= go
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -s -w -X main.Version=$(VERSION)
BINARIES  := sandboxd nook nook-mcp sandboxd-localcloud sandboxd-helper
# Each binary's package: ./cmd/NAME, but for nook-mcp (nook mcp's server,
# apart from nook so that nook starts fast), which shares nook's internals.
CMD_nook-mcp := ./cmd/nook/nook-mcp
cmds = $(foreach b,$(1),$(or $(CMD_$(b)),./cmd/$(b)))
# Built but not installed.
TOOLS     := sandboxd-bench
BIN       := ./bin
# Generated documentation (man pages, completions), laid out as under /usr/share.
SHARE     := $(BIN)/share
DIST      := ./dist

PREFIX           ?= $(HOME)/.local
SYSTEMD_USER_DIR ?= $(HOME)/.config/systemd/user
# macOS: the launchd user agent (packaging/launchd) instead of systemd units.
UNAME_S          := $(shell uname -s)
LAUNCH_AGENTS    ?= $(HOME)/Library/LaunchAgents
LAUNCHD_LABEL    := com.github.sandboxd.sandboxd
DESTDIR          ?=

# make test: go vet, the darwin builds and the whole suite, end-to-end
# tests included (run in parallel), must stay under 10 minutes on 2 cores,
# as .ci/run on a fresh clone: keep slow forms behind make test-long.
TEST_TIMEOUT ?= 15m
PKGS         ?= ./...
# The binaries the tests run are built once per run (plain and race-built)
# into TESTBIN, instead of by each package that needs them.
TESTBIN      := $(BIN)/test
# The race runtime sleeps a second at every exit of a race-built process
# by default; the tests start and stop hundreds of them.
TEST_ENV      = SANDBOXD_TEST_BIN=$(abspath $(TESTBIN)/plain) SANDBOXD_TEST_BIN_RACE=$(abspath $(TESTBIN)/race) \
	GORACE="$(strip $(GORACE) atexit_sleep_ms=0)"
# make bench: the benchmark program (BENCH_QUICK=1 for the quick version;
# BENCH_RTT=0,20ms the round-trip times of the local-remote rows,
# BENCH_RWX_RTT=0,20ms,100ms those of the RWX-path rows). make bench-go: the packages' Go
# micro-benchmarks, BENCH selects them, BENCH_PKGS the packages.
BENCH_RTT   ?= 0,20ms
BENCH_RWX_RTT ?= 0,20ms,100ms
BENCH       ?= .
BENCH_PKGS  ?= ./...
BENCHTIME   ?= 1s
# make fuzz: how long each fuzz target runs.
FUZZTIME    ?= 30s

.PHONY: all help build run test test-bin test-long fuzz bench bench-go install uninstall lint clean man completions package darwin

all: build

help:
	@echo "make build    build $(BINARIES) into $(BIN)/ (version $(VERSION))"
	@echo "make run      build, then run sandboxd in the foreground"
	@echo "make test     go vet, then go test -race ./... and packaging/'s (end-to-end tests included, in parallel; PKGS=./daemon/... narrows)"
	@echo "make test-long  the long forms of the load, fault and crash suites (SANDBOXD_TEST_LONG=1)"
	@echo "make fuzz     every fuzz target for FUZZTIME each ($(FUZZTIME)); make test runs their seed corpora"
	@echo "make bench    every exec scenario at 0 and 20 ms RTT, the RWX path at 0, 20 and 100 ms: table on stdout, JSON in $(BIN)/bench.json (BENCH_QUICK=1: quick)"
	@echo "make bench-go the packages' Go micro-benchmarks (BENCH=regexp BENCH_PKGS=./pkg/... BENCHTIME=1s)"
	@echo "make install  binaries to \$$PREFIX/bin ($(PREFIX)/bin), systemd user units to $(SYSTEMD_USER_DIR)"
	@echo "make man      man pages into $(SHARE)/man (generated from the command table)"
	@echo "make completions  bash, zsh and fish completions into $(SHARE) (generated too)"
	@echo "make package  .deb, .rpm and tarball into $(DIST)/ (packaging/nfpm/nfpm.yaml; GOARCH=arm64 for arm64)"
	@echo "make darwin   go vet and cross-build for macOS (amd64, arm64); make test runs it"
	@echo "make lint     gofmt and go vet"

# Static (CGO_ENABLED=0), as packaged: no dynamic loader and libc to map at
# every nook start (docs/performance.md).
build:
	@mkdir -p $(BIN)
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/ $(call cmds,$(BINARIES) $(TOOLS))

# make run: sandboxd in the foreground. The local remote it starts on demand
# (sandboxd-localcloud) outlives a daemon by design (its sandboxes survive a
# daemon restart), so make run stops it when it ends, Ctrl-C included, but
# only when it was not running before: a local remote that serves another
# daemon's sandboxes (or one already up) is left alone. sandboxd exits 3
# when a daemon already runs for this user (any earlier nook starts one).
run: build
	@echo "sandboxd $(VERSION) in the foreground (Ctrl-C stops it, and the local remote if it started it)"
	@echo "  socket: $$($(BIN)/sandboxd --print-socket)"
	@echo "  try:    $(BIN)/nook version      (from another terminal)"
	@echo
	@ours=; $(BIN)/sandboxd-localcloud status >/dev/null 2>&1 || ours=1; \
	trap '[ -z "$$ours" ] || $(BIN)/sandboxd-localcloud stop >/dev/null 2>&1 || true' EXIT; trap 'exit 130' INT TERM; \
	$(BIN)/sandboxd; rc=$$?; \
	if [ "$$rc" -eq 3 ]; then ours=; \
		echo "make run: a sandboxd already runs for this user (nook starts one on first use): use it as it is," >&2; \
		echo "  or stop it with '$(BIN)/nook daemon stop' and run make run again. The local remote and its sandboxes were left running." >&2; \
	fi; exit $$rc

# The man page and the completions are generated from nook's command table
# (cmd/nook/internal/cli/commands.go); nothing of them is kept by hand.
man: build
	@mkdir -p $(SHARE)/man/man1
	$(BIN)/nook man > $(SHARE)/man/man1/nook.1
	$(BIN)/sandboxd --man > $(SHARE)/man/man1/sandboxd.1

completions: build
	@mkdir -p $(SHARE)/bash-completion/completions $(SHARE)/zsh/site-functions $(SHARE)/fish/vendor_completions.d
	$(BIN)/nook completion bash > $(SHARE)/bash-completion/completions/nook
	$(BIN)/nook completion zsh > $(SHARE)/zsh/site-functions/_nook
	$(BIN)/nook completion fish > $(SHARE)/fish/vendor_completions.d/nook.fish

# make package: the .deb, the .rpm and the tarball, from the one definition in
# packaging/nfpm/nfpm.yaml (nfpm as a library, pinned in packaging/go.mod: the
# packaging tool is a module of its own, so that nfpm's dependencies stay out
# of the product's go.mod). The binaries are built for Linux and $(PKG_ARCH)
# (GOARCH=arm64 make package for arm64); the man pages and completions come
# from the host's build.
PKG_ARCH ?= $(or $(GOARCH),$(shell $(GO) env GOARCH))
package: man completions
	@mkdir -p $(DIST)/bin-$(PKG_ARCH)
	CGO_ENABLED=0 GOOS=linux GOARCH=$(PKG_ARCH) $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(DIST)/bin-$(PKG_ARCH)/ $(call cmds,$(BINARIES))
	cd packaging && GOOS= GOARCH= $(GO) run ./build -definition nfpm/nfpm.yaml -version '$(VERSION)' -arch $(PKG_ARCH) \
		-bin $(abspath $(DIST)/bin-$(PKG_ARCH)) -share $(abspath $(SHARE)) -out $(abspath $(DIST))

# The packaging module's tests (packaging/go.mod) run with the whole suite,
# not when PKGS narrows it.
test: darwin test-bin
	$(GO) vet $(PKGS)
	$(TEST_ENV) $(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) $(PKGS)
ifeq ($(PKGS),./...)
	cd packaging && $(GO) vet ./... && $(TEST_ENV) $(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) ./...
endif

test-bin:
	@mkdir -p $(TESTBIN)/plain $(TESTBIN)/race
	$(GO) build -o $(TESTBIN)/plain/ $(call cmds,$(BINARIES) $(TOOLS))
	$(GO) build -race -o $(TESTBIN)/race/ $(call cmds,$(BINARIES))

# macOS is built and vetted here, never run: go vet and a build of the
# three binaries for darwin/amd64 and darwin/arm64.
darwin:
	GOOS=darwin GOARCH=arm64 $(GO) vet ./...
	GOOS=darwin GOARCH=amd64 $(GO) build $(call cmds,$(BINARIES))
	GOOS=darwin GOARCH=arm64 $(GO) build $(call cmds,$(BINARIES))

# The long forms of the reliability suites (load, faults, crashes); make
# test runs their short forms.
test-long: test-bin
	$(TEST_ENV) SANDBOXD_TEST_LONG=1 $(GO) test -race -count=1 -timeout 40m -run 'Load|Fault|Crash|Untrusted' ./cmd/e2e/
	cd packaging && $(TEST_ENV) SANDBOXD_TEST_LONG=1 $(GO) test -count=1 -timeout 10m ./build/

fuzz:
	FUZZTIME=$(FUZZTIME) ./scripts/fuzz.sh

bench: build
	$(BIN)/sandboxd-bench -bin $(abspath $(BIN)) -rtt '$(BENCH_RTT)' -rwx-rtt '$(BENCH_RWX_RTT)' -json $(BIN)/bench.json

bench-go:
	$(GO) test -run '^$$' -bench '$(BENCH)' -benchmem -benchtime $(BENCHTIME) -count 1 -timeout 20m $(BENCH_PKGS)

# systemd reads user units only from these directories (systemd.unit(5));
# `systemctl` advice is printed only when SYSTEMD_USER_DIR is one of them.
SYSTEMD_USER_PATHS = $(HOME)/.config/systemd/user /etc/systemd/user $(HOME)/.local/share/systemd/user \
	/usr/local/share/systemd/user /usr/share/systemd/user /usr/local/lib/systemd/user /usr/lib/systemd/user

install: build man completions
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/man/man1 \
		$(DESTDIR)$(PREFIX)/share/bash-completion/completions $(DESTDIR)$(PREFIX)/share/zsh/site-functions \
		$(DESTDIR)$(PREFIX)/share/fish/vendor_completions.d
	install -m 0755 $(addprefix $(BIN)/,$(BINARIES)) $(DESTDIR)$(PREFIX)/bin/
	install -m 0644 $(SHARE)/man/man1/nook.1 $(SHARE)/man/man1/sandboxd.1 $(DESTDIR)$(PREFIX)/share/man/man1/
	install -m 0644 $(SHARE)/bash-completion/completions/nook $(DESTDIR)$(PREFIX)/share/bash-completion/completions/nook
	install -m 0644 $(SHARE)/zsh/site-functions/_nook $(DESTDIR)$(PREFIX)/share/zsh/site-functions/_nook
	install -m 0644 $(SHARE)/fish/vendor_completions.d/nook.fish $(DESTDIR)$(PREFIX)/share/fish/vendor_completions.d/nook.fish
ifeq ($(UNAME_S),Darwin)
	install -d $(DESTDIR)$(LAUNCH_AGENTS)
	sed -e 's|@SANDBOXD@|$(PREFIX)/bin/sandboxd|' -e 's|@LOG@|$(HOME)/Library/Logs/sandboxd.log|' \
		packaging/launchd/$(LAUNCHD_LABEL).plist > $(DESTDIR)$(LAUNCH_AGENTS)/$(LAUNCHD_LABEL).plist
	@echo
	@echo "Installed to $(DESTDIR)$(PREFIX), with the man pages and the bash, zsh and fish completions."
	@echo "To start sandboxd at login (nook also starts it on first use):"
	@echo "  launchctl bootstrap gui/$$(id -u) $(LAUNCH_AGENTS)/$(LAUNCHD_LABEL).plist"
else
	install -d $(DESTDIR)$(SYSTEMD_USER_DIR)
	install -m 0644 packaging/systemd/sandboxd.socket $(DESTDIR)$(SYSTEMD_USER_DIR)/sandboxd.socket
	sed 's|^ExecStart=.*|ExecStart=$(PREFIX)/bin/sandboxd|' packaging/systemd/sandboxd.service > $(DESTDIR)$(SYSTEMD_USER_DIR)/sandboxd.service
	chmod 0644 $(DESTDIR)$(SYSTEMD_USER_DIR)/sandboxd.service
	@echo
	@echo "Installed sandboxd, nook, nook-mcp and sandboxd-localcloud to $(DESTDIR)$(PREFIX)/bin, with the nook man page and"
	@echo "bash, zsh and fish completions under $(DESTDIR)$(PREFIX)/share (zsh: add $(PREFIX)/share/zsh/site-functions"
	@echo "to fpath if it is not there already)."
	@if [ -z "$(DESTDIR)" ] && [ -n "$(filter $(abspath $(SYSTEMD_USER_DIR)),$(SYSTEMD_USER_PATHS))" ]; then \
		echo "To let systemd start sandboxd on demand and at login:"; \
		echo "  systemctl --user daemon-reload"; \
		echo "  systemctl --user enable --now sandboxd.socket sandboxd.service"; \
	elif [ -z "$(DESTDIR)" ]; then \
		echo "The systemd units went to $(SYSTEMD_USER_DIR), which systemd does not read: link or copy them"; \
		echo "into ~/.config/systemd/user to use them (nook starts sandboxd by itself otherwise)."; \
	fi

endif

uninstall:
	rm -f $(addprefix $(DESTDIR)$(PREFIX)/bin/,$(BINARIES))
	rm -f $(DESTDIR)$(PREFIX)/share/man/man1/nook.1 $(DESTDIR)$(PREFIX)/share/man/man1/sandboxd.1 $(DESTDIR)$(PREFIX)/share/bash-completion/completions/nook \
		$(DESTDIR)$(PREFIX)/share/zsh/site-functions/_nook $(DESTDIR)$(PREFIX)/share/fish/vendor_completions.d/nook.fish
	rm -f $(DESTDIR)$(SYSTEMD_USER_DIR)/sandboxd.socket $(DESTDIR)$(SYSTEMD_USER_DIR)/sandboxd.service
	rm -f $(DESTDIR)$(LAUNCH_AGENTS)/$(LAUNCHD_LABEL).plist

lint:
	@unformatted="$$(gofmt -l .)"; \
	if [ -n "$$unformatted" ]; then echo "gofmt needed on:"; echo "$$unformatted"; exit 1; fi
	$(GO) vet ./...
	cd packaging && $(GO) vet ./...

clean:
	rm -rf $(BIN) $(DIST)
