package gitsync

import (
	"os"
	"path/filepath"
	"strings"
)

// ackFile lists, in the local repository, the ids of the latest execs whose
// edits were applied or saved here: a push passes them to the sandbox,
// which may then discard those edits.
const ackFile = "pulled"

// keptAcks bounds the list; one repository rarely has more sandboxes.
const keptAcks = 32

func (s *Syncer) acks(rp repo) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return readAcks(rp)
}

func readAcks(rp repo) []string {
	b, err := os.ReadFile(filepath.Join(rp.stateDir(), ackFile))
	if err != nil {
		return nil
	}
	var ids []string
	for _, f := range strings.Fields(string(b)) {
		if isID(f) {
			ids = append(ids, f)
		}
	}
	return ids
}

// ack records that exec id's edits are applied or saved locally. A failure
// is logged only: the next push then brings the edits back once more, and
// they are found already applied.
func (s *Syncer) ack(rp repo, id string) {
	if !isID(id) {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	ids := readAcks(rp)
	for _, have := range ids {
		if have == id {
			return
		}
	}
	ids = append(ids, id)
	if len(ids) > keptAcks {
		ids = ids[len(ids)-keptAcks:]
	}
	dir := rp.stateDir()
	if err := os.MkdirAll(dir, 0o755); err == nil {
		tmp := filepath.Join(dir, ackFile+".tmp")
		if err = os.WriteFile(tmp, []byte(strings.Join(ids, "\n")+"\n"), 0o644); err == nil {
			err = os.Rename(tmp, filepath.Join(dir, ackFile))
		}
		if err == nil {
			return
		}
		s.log.Warn("record a pulled exec", "repo", rp.root, "err", err)
	}
}

// isID accepts the ids newID makes (hex), so nothing else reaches a script.
func isID(id string) bool {
	if len(id) == 0 || len(id) > 64 {
		return false
	}
	for _, c := range id {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

func (s *Syncer) knownPushed(sandbox, head string) bool {
	if sandbox == "" {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pushed[sandbox] == head
}

func (s *Syncer) remember(sandbox, head string) {
	if sandbox == "" {
		return
	}
	s.mu.Lock()
	s.pushed[sandbox] = head
	s.mu.Unlock()
}

func (s *Syncer) forget(sandbox string) {
	s.mu.Lock()
	delete(s.pushed, sandbox)
	s.mu.Unlock()
}
