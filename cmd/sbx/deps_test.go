package main

import (
	"os/exec"
	"strings"
	"testing"
)

// sbxDeps lists the packages sbx links.
func sbxDeps(t *testing.T) []string {
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

// sbx starts on every call an agent makes: it must not link the MCP server
// (sbx-mcp's), whose package initialisation each start would pay.
func TestSbxDoesNotLinkTheMCPServer(t *testing.T) {
	for _, pkg := range sbxDeps(t) {
		for _, banned := range []string{"github.com/modelcontextprotocol/", "github.com/google/jsonschema-go/", "github.com/sandboxd/sandboxd/cmd/sbx/internal/mcp"} {
			if strings.HasPrefix(pkg, banned) {
				t.Errorf("sbx links %s: keep the MCP server in sbx-mcp (cmd/sbx/sbx-mcp)", pkg)
			}
		}
	}
}

// sbx stays thin: it speaks the socket API's HTTP/1.1 itself (ipc/client)
// and needs the wire types only (ipc), so it links no HTTP client or
// server machinery, router or TLS, whose package initialisation and pages
// every start would pay.
func TestSbxDoesNotLinkHTTPMachinery(t *testing.T) {
	for _, pkg := range sbxDeps(t) {
		for _, banned := range []string{"net/http", "net/url", "net/textproto", "mime", "crypto/tls", "crypto/x509", "github.com/gorilla/mux", "github.com/sandboxd/sandboxd/ipc/server"} {
			if within(pkg, banned) {
				t.Errorf("sbx links %s: keep sbx thin (ipc holds the wire types without HTTP machinery; ipc/client speaks HTTP/1.1 by hand; the server is ipc/server)", pkg)
			}
		}
	}
}

// sbx dials the daemon's socket itself (ipc/client's dialUnix): package
// net, its initialisation and its size are not paid by every command.
func TestSbxDoesNotLinkNet(t *testing.T) {
	for _, pkg := range sbxDeps(t) {
		if pkg == "net" {
			t.Errorf("sbx links net: ipc/client dials the Unix socket with system calls so that sbx starts without it")
		}
	}
}
