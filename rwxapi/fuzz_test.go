package rwxapi

import (
	"encoding/base64"
	"testing"
)

// FuzzDecodeCLIState: any cli_state a remote hands back (written by us, by
// the RWX CLI, or by anything else) decodes or fails with an error; never a
// panic. What decodes survives its own round trip unchanged, so a state we
// re-stamp on a run reads back as the same identity.
func FuzzDecodeCLIState(f *testing.F) {
	for _, s := range []string{
		CLIState{Branch: "main", ConfigFile: "/src/repo/.rwx/sandbox.yml"}.Encode(),
		CLIState{Branch: "detached@abc1234", ConfigFile: "/r/.rwx/s.yml", RepoRoot: "/r", OriginURL: "git@example.com:o/r.git", ConfigRel: ".rwx/s.yml"}.Encode(),
		base64.StdEncoding.EncodeToString([]byte(`{"branch":"x","configFile":"y","future":{"a":[1,2]}}`)),
		base64.StdEncoding.EncodeToString([]byte(`{"branch":1}`)),
		base64.StdEncoding.EncodeToString([]byte("{\"branch\":\"\xff\xfe\"}")),
		base64.StdEncoding.EncodeToString([]byte(`null`)),
		"not base64!",
		"",
		"eyJicmFuY2giOiJtYWluIn0", // unpadded
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, encoded string) {
		s, err := DecodeCLIState(encoded)
		if err != nil {
			if err.Error() == "" {
				t.Fatal("an error without a message")
			}
			return
		}
		back, err := DecodeCLIState(s.Encode())
		if err != nil {
			t.Fatalf("re-decode of our own encoding of %+v: %v", s, err)
		}
		if back != s {
			t.Fatalf("round trip changed the state: %+v -> %+v", s, back)
		}
	})
}
