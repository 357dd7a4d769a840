package sandboxhelper

import (
	"encoding/json"
	"reflect"
	"testing"
)

// run passes the push's entries on undecoded: what it sends is read by the
// server as the pushRequest the daemon meant.
func TestForwardedPushIsThePushRequest(t *testing.T) {
	want := pushRequest{Head: "0123456789abcdef0123456789abcdef01234567", Time: 1700000000, SnapRef: "refs/sandboxd/snap", BaseRef: "refs/sandboxd/base",
		Entries: []PushEntry{{Path: "a.txt", Mode: 0o100644, Data: []byte("a\n")}, {Path: "gone", OID: "x"}}}
	raw, err := json.Marshal(want.Entries)
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(forwardedPush{Head: want.Head, Entries: raw, Time: want.Time, SnapRef: want.SnapRef, BaseRef: want.BaseRef})
	if err != nil {
		t.Fatal(err)
	}
	var got pushRequest
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("the server reads %+v, want %+v", got, want)
	}
}
