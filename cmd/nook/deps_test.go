package main

import (
	"os/exec"
	"strings"
	"testing"
)

// nookDeps lists the packages nook links.
func nookDeps(t *testing.T) []string {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	return strings.Fields(string(out))
}

// within reports whether pkg is root or one of its subpackages.
func within(pkg, root string) bool {
	return pkg == root || strings.HasPrefix(pkg, root+"/")
}

// nook starts on every call an agent makes: it must not link the MCP server
// (nook-mcp's), whose package initialisation each start would pay.
func TestNookDoesNotLinkTheMCPServer(t *testing.T) {
	for _, pkg := range nookDeps(t) {
		for _, banned := range []string{"github.com/modelcontextprotocol/", "github.com/google/jsonschema-go/", "github.com/sandboxd/sandboxd/cmd/nook/internal/mcp"} {
			if strings.HasPrefix(pkg, banned) {
				t.Errorf("nook links %s: keep the MCP server in nook-mcp (cmd/nook/nook-mcp)", pkg)
			}
		}
	}
}

// nook stays thin: it speaks the socket API's HTTP/1.1 itself (ipc/client)
// and needs the wire types only (ipc), so it links no HTTP client or
// server machinery, router or TLS, whose package initialisation and pages
// every start would pay.
func TestNookDoesNotLinkHTTPMachinery(t *testing.T) {
	for _, pkg := range nookDeps(t) {
		for _, banned := range []string{"net/http", "net/url", "net/textproto", "mime", "crypto/tls", "crypto/x509", "github.com/gorilla/mux", "github.com/sandboxd/sandboxd/ipc/server"} {
			if within(pkg, banned) {
				t.Errorf("nook links %s: keep nook thin (ipc holds the wire types without HTTP machinery; ipc/client speaks HTTP/1.1 by hand; the server is ipc/server)", pkg)
			}
		}
	}
}

// nook dials the daemon's socket itself (ipc/client's dialUnix): package
// net, its initialisation and its size are not paid by every command.
func TestNookDoesNotLinkNet(t *testing.T) {
	for _, pkg := range nookDeps(t) {
		if pkg == "net" {
			t.Errorf("nook links net: ipc/client dials the Unix socket with system calls so that nook starts without it")
		}
	}
}
