package sandboxhelper

import "github.com/sandboxd/sandboxd/internal/helperproto"

// The contract with the daemon is package helperproto's, which both sides
// import; these names keep the helper's code as it reads.
const (
	Name       = helperproto.Name
	Ready      = helperproto.Ready
	PullHeader = helperproto.PullHeader
)

type PushEntry = helperproto.PushEntry

// ValidPath is helperproto.ValidPath.
func ValidPath(p string) bool { return helperproto.ValidPath(p) }

// ConvertingAttribute is helperproto.ConvertingAttribute.
func ConvertingAttribute(data []byte) string { return helperproto.ConvertingAttribute(data) }
