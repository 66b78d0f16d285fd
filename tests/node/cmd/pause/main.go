// Command pause is the pod sandbox ("pause") image's only program: it sleeps until it
// is sent SIGTERM or SIGINT, then exits 0. containerd runs it as the infra container of
// every pod; the node tests build it, put it alone in a FROM scratch image and import
// that image, because no registry (and so no registry.k8s.io/pause) is reachable.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGTERM, syscall.SIGINT)
	<-c
}
