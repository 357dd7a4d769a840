# sandboxd — build, run, test, install. `make help` lists the targets.

SHELL := /bin/bash
export PATH := /usr/local/go/bin:$(PATH)

GO        ?= go
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -s -w -X main.Version=$(VERSION)
BINARIES  := sandboxd sbx sandboxd-localcloud
BIN       := ./bin

PREFIX           ?= $(HOME)/.local
SYSTEMD_USER_DIR ?= $(HOME)/.config/systemd/user
DESTDIR          ?=

# make test: the whole suite, end-to-end tests included, must stay well
# under 15 minutes on 2 cores.
TEST_TIMEOUT ?= 14m
PKGS         ?= ./...
# make bench: BENCH selects benchmarks, BENCH_PKGS the packages.
BENCH       ?= .
BENCH_PKGS  ?= ./...
BENCHTIME   ?= 1s

.PHONY: all help build run test bench install uninstall lint clean

all: build

help:
	@echo "make build    build $(BINARIES) into $(BIN)/ (version $(VERSION))"
	@echo "make run      build, then run sandboxd in the foreground"
	@echo "make test     go vet, then go test -race ./... (end-to-end tests included; PKGS=./daemon/... narrows)"
	@echo "make bench    benchmarks (BENCH=regexp BENCH_PKGS=./pkg/... BENCHTIME=1s)"
	@echo "make install  binaries to \$$PREFIX/bin ($(PREFIX)/bin), systemd user units to $(SYSTEMD_USER_DIR)"
	@echo "make lint     gofmt and go vet"

build:
	@mkdir -p $(BIN)
	$(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/ $(addprefix ./cmd/,$(BINARIES))

run: build
	@echo "sandboxd $(VERSION) in the foreground (Ctrl-C stops it)"
	@echo "  socket: $$($(BIN)/sandboxd --print-socket)"
	@echo "  try:    $(BIN)/sbx version      (from another terminal)"
	@echo
	exec $(BIN)/sandboxd

test:
	$(GO) vet $(PKGS)
	$(GO) test -race -count=1 -timeout $(TEST_TIMEOUT) $(PKGS)

bench:
	$(GO) test -run '^$$' -bench '$(BENCH)' -benchmem -benchtime $(BENCHTIME) -count 1 -timeout 20m $(BENCH_PKGS)

install: build
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(SYSTEMD_USER_DIR)
	install -m 0755 $(addprefix $(BIN)/,$(BINARIES)) $(DESTDIR)$(PREFIX)/bin/
	install -m 0644 packaging/systemd/sandboxd.socket $(DESTDIR)$(SYSTEMD_USER_DIR)/sandboxd.socket
	sed 's|^ExecStart=.*|ExecStart=$(PREFIX)/bin/sandboxd|' packaging/systemd/sandboxd.service > $(DESTDIR)$(SYSTEMD_USER_DIR)/sandboxd.service
	chmod 0644 $(DESTDIR)$(SYSTEMD_USER_DIR)/sandboxd.service
	@echo
	@echo "Installed. To let systemd start sandboxd on demand and at login:"
	@echo "  systemctl --user daemon-reload"
	@echo "  systemctl --user enable --now sandboxd.socket sandboxd.service"

uninstall:
	rm -f $(addprefix $(DESTDIR)$(PREFIX)/bin/,$(BINARIES))
	rm -f $(DESTDIR)$(SYSTEMD_USER_DIR)/sandboxd.socket $(DESTDIR)$(SYSTEMD_USER_DIR)/sandboxd.service

lint:
	@unformatted="$$(gofmt -l .)"; \
	if [ -n "$$unformatted" ]; then echo "gofmt needed on:"; echo "$$unformatted"; exit 1; fi
	$(GO) vet ./...

clean:
	rm -rf $(BIN)
