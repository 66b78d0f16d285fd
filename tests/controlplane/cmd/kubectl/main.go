// Command kubectl is the published k8s.io/kubectl command, built for the local
// control plane.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubectl/pkg/cmd"
)

func main() {
	command := cmd.NewDefaultKubectlCommand()
	os.Exit(cli.Run(command))
}
