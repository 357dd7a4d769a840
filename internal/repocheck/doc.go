// Package repocheck holds no code: its tests check the repository itself:
// what git tracks and what it ignores, so that `make test` keeps build
// outputs out of the history, and which way its packages' dependencies
// point (deps_test.go).
package repocheck
