//go:build tools

// Package tools pins the commands this module builds so that go mod tidy keeps them.
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
