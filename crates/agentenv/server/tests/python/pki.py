"""A throwaway certificate authority for the cluster tests (etcd, nodes and gateways over mutual TLS)."""

import os
import subprocess

# The DNS name of a gateway's client certificate (crates/agentenv/cluster/src/node_tls.rs).
GATEWAY_NAME = "gateway.agentenv.internal"


class Pki:
    """A throwaway CA (the `openssl` command): certificates for server and client use on 127.0.0.1."""

    def __init__(self, d):
        self.d = d
        os.makedirs(d)
        self._openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                      "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=k3-test-ca")
        self.ca = f"{d}/ca.pem"

    def _openssl(self, *args):
        subprocess.run(["openssl", *args], cwd=self.d, check=True, capture_output=True)

    def issue(self, cn, subject=None):
        """(cert, key) paths of a certificate with common name `cn` (or, named `cn`, of `subject`), also
        valid for 127.0.0.1 and DNS name `cn` (a node's id: gateways check it)."""
        with open(f"{self.d}/{cn}.ext", "w") as f:
            f.write(f"subjectAltName=IP:127.0.0.1,DNS:{cn}\nextendedKeyUsage=serverAuth,clientAuth\n")
        self._openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                      "-keyout", f"{cn}.key", "-out", f"{cn}.csr", "-subj", subject or f"/CN={cn}")
        self._openssl("x509", "-req", "-in", f"{cn}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                      "-CAcreateserial", "-out", f"{cn}.pem", "-days", "1", "-extfile", f"{cn}.ext")
        return f"{self.d}/{cn}.pem", f"{self.d}/{cn}.key"

    def flags(self, cn):
        cert, key = self.issue(cn)
        return ["--etcd-ca", self.ca, "--etcd-cert", cert, "--etcd-key", key]
