package main

import (
	"os/exec"
	"strings"
	"testing"
)

// sbx starts on every call an agent makes: it must not link the MCP server
// (sbx-mcp's), whose package initialisation each start would pay.
func TestSbxDoesNotLinkTheMCPServer(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	for _, pkg := range strings.Fields(string(out)) {
		for _, banned := range []string{"github.com/modelcontextprotocol/", "github.com/google/jsonschema-go/", "github.com/sandboxd/sandboxd/cmd/sbx/internal/mcp"} {
			if strings.HasPrefix(pkg, banned) {
				t.Errorf("sbx links %s: keep the MCP server in sbx-mcp (cmd/sbx/sbx-mcp)", pkg)
			}
		}
	}
}
