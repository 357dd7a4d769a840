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

// nook is a client: it speaks the socket API through ipc/client (net/http
// over a Unix dialer) and needs the wire types (ipc), never the daemon's
// router or server.
func TestNookDoesNotLinkTheServer(t *testing.T) {
	for _, pkg := range nookDeps(t) {
		for _, banned := range []string{"github.com/gorilla/mux", "github.com/sandboxd/sandboxd/ipc/server", "github.com/sandboxd/sandboxd/daemon/sessions"} {
			if within(pkg, banned) {
				t.Errorf("nook links %s: keep the server in the daemon (ipc/server, daemon/sessions); nook needs ipc and ipc/client only", pkg)
			}
		}
	}
}
