"""The TLS tests' CA and role certificates: pdserve's own (`pdserve.cluster.certs`, what
`pdserve certs` and `pdserve up --tls-dir` issue), so the tests check the certificates
people get. Each says its role in its Subject OU and names localhost and 127.0.0.1."""

from __future__ import annotations

from pdserve.cluster.certs import ClusterCA, Issued

__all__ = ["ClusterCA", "Issued"]
