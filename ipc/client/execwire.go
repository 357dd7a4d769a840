package client

import (
	"encoding/base64"
	"encoding/json"
	"sort"
	"strconv"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/sandboxd/sandboxd/ipc"
)

// The exec's frames are coded by hand on nook's path: encoding/json works a
// type's fields out by reflection the first time it meets the type, a
// sizeable share of the CPU a short-lived `nook exec` costs. What the hand
// code does not take (a string that is not UTF-8, a key it does not know, a
// null, a number that is not an integer) goes to encoding/json, so the hand
// code only has to agree with it where it answers; FuzzExecWire checks that.

// appendExecRequest appends req as JSON; ok is false when encoding/json must
// do it.
func appendExecRequest(b []byte, req ipc.ExecRequest) (_ []byte, ok bool) {
	w := jsonObject{b: append(b, '{')}
	w.str("cwd", req.Cwd, true)
	w.str("configFile", req.ConfigFile, true)
	w.str("runId", req.RunID, true)
	w.key("argv")
	if req.Argv == nil {
		w.b = append(w.b, "null"...)
	} else {
		w.b = append(w.b, '[')
		for i, a := range req.Argv {
			if i > 0 {
				w.b = append(w.b, ',')
			}
			var good bool
			if w.b, good = appendString(w.b, a, true); !good {
				w.bad = true
			}
		}
		w.b = append(w.b, ']')
	}
	w.flag("noSync", req.NoSync)
	w.flag("reset", req.Reset)
	w.flag("root", req.Root)
	if len(req.Env) > 0 {
		w.key("env")
		keys := make([]string, 0, len(req.Env))
		for k := range req.Env {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		inner := jsonObject{b: append(w.b, '{')}
		for _, k := range keys {
			inner.str(k, req.Env[k], false)
		}
		w.end(inner)
	}
	w.flag("stdin", req.Stdin)
	if req.TTY != nil {
		w.key("tty")
		inner := jsonObject{b: append(w.b, '{')}
		inner.str("term", req.TTY.Term, true)
		inner.int("cols", int64(req.TTY.Cols))
		inner.int("rows", int64(req.TTY.Rows))
		w.end(inner)
	}
	w.flag("detach", req.Detach)
	w.str("attach", req.Attach, true)
	return append(w.b, '}'), !w.bad
}

// appendExecInput appends an uplink frame as JSON.
func appendExecInput(b []byte, in ipc.ExecInput) (_ []byte, ok bool) {
	w := jsonObject{b: append(b, '{')}
	if len(in.Stdin) > 0 {
		w.key("stdin")
		w.b = append(w.b, '"')
		w.b = base64.StdEncoding.AppendEncode(w.b, in.Stdin)
		w.b = append(w.b, '"')
	}
	w.flag("stdinEof", in.StdinEOF)
	w.str("signal", in.Signal, true)
	if in.Resize != nil {
		w.key("resize")
		inner := jsonObject{b: append(w.b, '{')}
		inner.int("cols", int64(in.Resize.Cols))
		inner.int("rows", int64(in.Resize.Rows))
		w.end(inner)
	}
	return append(w.b, '}'), !w.bad
}

// jsonObject writes an object's members; more is true once one is written
// (the next needs a comma), bad once a string could not be written.
type jsonObject struct {
	b         []byte
	more, bad bool
}

func (w *jsonObject) key(k string) {
	if w.more {
		w.b = append(w.b, ',')
	}
	w.more = true
	w.b = append(w.b, '"')
	w.b = append(w.b, k...)
	w.b = append(w.b, '"', ':')
}

// end closes inner, an object that is w's member's value.
func (w *jsonObject) end(inner jsonObject) {
	w.b = append(inner.b, '}')
	w.bad = w.bad || inner.bad
}

func (w *jsonObject) str(k, v string, omitEmpty bool) {
	if omitEmpty && v == "" {
		return
	}
	if w.more {
		w.b = append(w.b, ',')
	}
	w.more = true
	var good bool
	if w.b, good = appendString(w.b, k, true); !good {
		w.bad = true
	}
	w.b = append(w.b, ':')
	if w.b, good = appendString(w.b, v, true); !good {
		w.bad = true
	}
}

func (w *jsonObject) flag(k string, v bool) {
	if v {
		w.key(k)
		w.b = append(w.b, "true"...)
	}
}

func (w *jsonObject) int(k string, v int64) {
	w.key(k)
	w.b = strconv.AppendInt(w.b, v, 10)
}

// appendString appends s as a JSON string; good is false (and stays false)
// when s is not valid UTF-8, which encoding/json would change.
func appendString(b []byte, s string, good bool) ([]byte, bool) {
	if !utf8.ValidString(s) {
		good = false
	}
	const hex = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c < 0x20:
			b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		default:
			b = append(b, c)
		}
	}
	return append(b, '"'), good
}

// decodeExecOutput decodes one frame (one JSON object, nothing after it but
// spaces); ok is false when encoding/json must.
func decodeExecOutput(b []byte) (f ipc.ExecOutput, ok bool) {
	d := jsonReader{b: b}
	ok = d.object(func(k string) (ok bool) {
		switch k {
		case "type":
			f.Type, ok = d.string()
		case "message":
			f.Message, ok = d.string()
		case "position":
			f.Position, ok = d.smallInt()
		case "data":
			var s string
			if s, ok = d.string(); ok {
				f.Data = make([]byte, base64.StdEncoding.DecodedLen(len(s)))
				n, err := base64.StdEncoding.Decode(f.Data, []byte(s))
				f.Data, ok = f.Data[:n], err == nil
			}
		// A repeated key fills the same value, as encoding/json does.
		case "result":
			if f.Result == nil {
				f.Result = &ipc.ExecResult{}
			}
			ok = d.execResult(f.Result)
		case "error":
			if f.Error == nil {
				f.Error = &ipc.ErrorDetail{}
			}
			ok = d.errorDetail(f.Error)
		}
		return ok
	})
	d.space()
	return f, ok && d.i == len(d.b)
}

func (d *jsonReader) execResult(r *ipc.ExecResult) bool {
	return d.object(func(k string) (ok bool) {
		switch k {
		case "runId":
			r.RunID, ok = d.string()
		case "runUrl":
			r.RunURL, ok = d.string()
		case "signal":
			r.Signal, ok = d.string()
		case "exitCode":
			r.ExitCode, ok = d.smallInt()
		case "durationMs":
			r.DurationMs, ok = d.int()
		case "pulledFiles":
			r.PulledFiles, ok = d.strings()
		case "warnings":
			r.Warnings, ok = d.strings()
		case "execId":
			r.ExecID, ok = d.string()
		}
		return ok
	})
}

func (d *jsonReader) errorDetail(e *ipc.ErrorDetail) bool {
	return d.object(func(k string) (ok bool) {
		switch k {
		case "code":
			e.Code, ok = d.string()
		case "message":
			e.Message, ok = d.string()
		}
		return ok
	})
}

// jsonReader reads the JSON the exec's frames hold: objects, arrays of
// strings, strings and integers. Anything else is a false answer.
type jsonReader struct {
	b []byte
	i int
}

func (d *jsonReader) space() {
	for d.i < len(d.b) {
		switch d.b[d.i] {
		case ' ', '\t', '\n', '\r':
			d.i++
		default:
			return
		}
	}
}

func (d *jsonReader) byte(c byte) bool {
	d.space()
	if d.i < len(d.b) && d.b[d.i] == c {
		d.i++
		return true
	}
	return false
}

// object reads an object, calling member for each key with the reader at
// the key's value.
func (d *jsonReader) object(member func(key string) bool) bool {
	if !d.byte('{') {
		return false
	}
	if d.byte('}') {
		return true
	}
	for {
		k, ok := d.string()
		if !ok || !d.byte(':') || !member(k) {
			return false
		}
		if d.byte('}') {
			return true
		}
		if !d.byte(',') {
			return false
		}
	}
}

func (d *jsonReader) strings() ([]string, bool) {
	if !d.byte('[') {
		return nil, false
	}
	out := []string{}
	if d.byte(']') {
		return out, true
	}
	for {
		s, ok := d.string()
		if !ok {
			return nil, false
		}
		out = append(out, s)
		if d.byte(']') {
			return out, true
		}
		if !d.byte(',') {
			return nil, false
		}
	}
}

func (d *jsonReader) int() (int64, bool) {
	d.space()
	j := d.i
	if j < len(d.b) && d.b[j] == '-' {
		j++
	}
	digits := j
	for j < len(d.b) && d.b[j] >= '0' && d.b[j] <= '9' {
		j++
	}
	// JSON has no leading zeros; a fraction or exponent is not an int.
	if j == digits || (d.b[digits] == '0' && j-digits > 1) || (j < len(d.b) && (d.b[j] == '.' || d.b[j] == 'e' || d.b[j] == 'E')) {
		return 0, false
	}
	n, err := strconv.ParseInt(string(d.b[d.i:j]), 10, 64)
	d.i = j
	return n, err == nil
}

// smallInt is int for a Go int field: one it does not fit is left to
// encoding/json.
func (d *jsonReader) smallInt() (int, bool) {
	n, ok := d.int()
	return int(n), ok && int64(int(n)) == n
}

func (d *jsonReader) string() (string, bool) {
	if !d.byte('"') {
		return "", false
	}
	start := d.i
	plain := true
	for d.i < len(d.b) {
		c := d.b[d.i]
		switch {
		case c == '"':
			raw := d.b[start:d.i]
			d.i++
			if plain {
				return string(raw), utf8.Valid(raw)
			}
			return unescape(raw)
		case c == '\\':
			plain = false
			d.i += 2
		case c < 0x20:
			return "", false
		default:
			d.i++
		}
	}
	return "", false
}

// unescape decodes a string's escapes; surrogates and text that is not
// UTF-8 are left to encoding/json.
func unescape(raw []byte) (string, bool) {
	if !utf8.Valid(raw) {
		return "", false
	}
	out := make([]byte, 0, len(raw))
	for i := 0; i < len(raw); i++ {
		c := raw[i]
		if c != '\\' {
			out = append(out, c)
			continue
		}
		i++
		if i >= len(raw) {
			return "", false
		}
		switch raw[i] {
		case '"', '\\', '/':
			out = append(out, raw[i])
		case 'b':
			out = append(out, '\b')
		case 'f':
			out = append(out, '\f')
		case 'n':
			out = append(out, '\n')
		case 'r':
			out = append(out, '\r')
		case 't':
			out = append(out, '\t')
		case 'u':
			if i+4 >= len(raw) {
				return "", false
			}
			n, err := strconv.ParseUint(string(raw[i+1:i+5]), 16, 16)
			if err != nil || utf16.IsSurrogate(rune(n)) {
				return "", false
			}
			out = utf8.AppendRune(out, rune(n))
			i += 4
		default:
			return "", false
		}
	}
	return string(out), true
}

// decodeFrame is decodeExecOutput, or encoding/json when it declines.
func decodeFrame(b []byte) (ipc.ExecOutput, error) {
	if f, ok := decodeExecOutput(b); ok {
		return f, nil
	}
	var f ipc.ExecOutput
	err := json.Unmarshal(b, &f)
	return f, err
}
