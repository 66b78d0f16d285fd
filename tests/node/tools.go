//go:build tools

// Package tools pins the commands this module builds so that go mod tidy keeps them.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
