"""`make demo` and the test harness: the real operator and webhook against kmock's
in-process Kubernetes API, with self-signed certificates. Needs the `demo` extra (kmock,
cryptography); the shipped operator package (kvtier_operator) never imports this one."""
