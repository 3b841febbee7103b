"""Stand-in for mmengine (README.md): only the registry LMDeploy uses."""
