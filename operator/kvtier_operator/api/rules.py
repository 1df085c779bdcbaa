"""Rules for the strings of a TieredPrefixCache, each written once.

A rule is a regular expression (RE2 and Python `re` read it alike: anchored, no
backslashes, so it also fits in a CEL string literal), a length limit and one message
that says what is wanted. The models apply it (so the validating webhook and
`kvtier render` do), and the CRD carries it as `pattern`/`maxLength` or as a CEL rule
with the same message, so the API server refuses the same values first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Rule:
    regex: str
    max_length: int
    message: str
    refuse_match: bool = False  # the value must NOT match regex
    _compiled: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if "\\" in self.regex or "'" in self.regex:
            raise ValueError(f"rule regex must not contain a backslash or quote: {self.regex}")
        if not (self.regex.startswith("^") and self.regex.endswith("$")):
            raise ValueError(f"rule regex must be anchored: {self.regex}")
        object.__setattr__(self, "_compiled", re.compile(self.regex))

    def holds(self, value: str) -> bool:
        matched = self._compiled.fullmatch(value) is not None
        return len(value) <= self.max_length and matched != self.refuse_match

    def check(self, value: str) -> str:
        """`value`, or ValueError naming it (shortened) and the rule's message."""
        if len(value) > self.max_length:
            raise ValueError(f"{shown(value)} is {len(value)} characters, more than "
                             f"{self.max_length}; {self.message}")
        if not self.holds(value):
            raise ValueError(f"{shown(value)} {self.message}")
        return value

    def cel(self) -> dict[str, str]:
        negation = "!" if self.refuse_match else ""
        return {"rule": f"{negation}self.matches('{self.regex}')", "message": self.message}

    def schema(self) -> dict[str, Any]:
        """The CRD schema of a string field under this rule: maxLength and a CEL rule
        carrying the message (a string with a maxLength keeps the rule's cost small)."""
        return {"type": "string", "maxLength": self.max_length,
                "x-kubernetes-validations": [self.cel()]}

    def pattern_schema(self) -> dict[str, Any]:
        """For the CRD where CEL would cost too much: maxLength and pattern, no message."""
        assert not self.refuse_match
        return {"maxLength": self.max_length, "pattern": self.regex}


def shown(value: str, limit: int = 40) -> str:
    """repr(value), cut to `limit` characters so a hostile value cannot flood a message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = f"{_LABEL}([.]{_LABEL})*"
_LABEL_NAME = "[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
DNS_SUBDOMAIN_REGEX = f"^{_SUBDOMAIN}$"


def dns_label(what: str) -> Rule:
    return Rule(f"^{_LABEL}$", 63, f"must be a valid {what}: at most 63 lowercase letters, "
                "digits and '-', starting and ending with a letter or digit (a DNS-1123 label)")


def dns_subdomain(what: str, max_length: int = 253) -> Rule:
    return Rule(DNS_SUBDOMAIN_REGEX, max_length,
                f"must be a valid {what}: at most {max_length} lowercase letters, digits, '-' "
                "and '.', starting and ending with a letter or digit (a DNS-1123 subdomain)")


CONTAINER_NAME = dns_label("container name")
CLAIM_NAME = dns_subdomain("PersistentVolumeClaim name")
STORAGE_CLASS_NAME = dns_subdomain("StorageClass name")
CONFIG_MAP_NAME = dns_subdomain("ConfigMap name")
NAMESPACE = dns_label("namespace")
SERVICE_NAME = dns_label("Service name")
DAEMON_SET_NAME = dns_subdomain("DaemonSet name")
# An extended resource a device plugin advertises (rdma/ib): prefix/name, as a label key
# but with the prefix required. It reaches the pod's resources, never a shell.
RESOURCE_NAME = Rule(f"^{_SUBDOMAIN}/{_LABEL_NAME}$", 253 + 1 + 63,
                     "must be an extended resource name: a DNS-1123 subdomain prefix, '/' "
                     "and a name of letters, digits, '-', '_' and '.' (e.g. rdma/ib)")
# Where the evictor publishes KV events (a ZMQ endpoint it connects to): tcp, a host name
# or IPv4 address, a port. It reaches the evictor's argv (never a shell).
ZMQ_ENDPOINT = Rule(r"^tcp://[A-Za-z0-9]([-.A-Za-z0-9]{0,251}[A-Za-z0-9])?:[0-9]{1,5}$", 272,
                    "must be tcp://<host>:<port>, e.g. tcp://epp.llm-d.svc:5557")
CONFIG_MAP_KEY = Rule("^[-._a-zA-Z0-9]+$", 253,
                      "must be a ConfigMap key: letters, digits, dashes, dots and underscores")
# kvtier names a CronJob <name>-evictor; Kubernetes caps CronJob names at 52 characters.
CR_NAME_MAX = 52 - len("-evictor")
CR_NAME = Rule(DNS_SUBDOMAIN_REGEX, CR_NAME_MAX,
               f"must be at most {CR_NAME_MAX} lowercase letters, digits, '-' and '.', "
               "starting and ending with a letter or digit: kvtier names a CronJob "
               "<name>-evictor (capped at 52) and labels its objects with the name; shorten "
               "or rename it")

LABEL_VALUE = Rule(f"^({_LABEL_NAME})?$", 63,
                   "must be a valid label value: empty, or at most 63 letters, digits, '-', "
                   "'_' and '.', starting and ending with a letter or digit")
# prefix/name; the prefix (a DNS-1123 subdomain) may hold 253 characters, the name 63.
LABEL_KEY = Rule(f"^({_SUBDOMAIN}/)?{_LABEL_NAME}$", 253 + 1 + 63,
                 "must be a valid label key: an optional DNS-1123 subdomain prefix of at most "
                 "253 characters and '/', then a name of at most 63 letters, digits, '-', '_' "
                 "and '.' starting and ending with a letter or digit (e.g. llm-d.ai/role)")


def check_label_key(value: str) -> str:
    """LABEL_KEY, plus the part lengths Kubernetes checks (a regex cannot count them)."""
    LABEL_KEY.check(value)
    prefix, _, name = value.rpartition("/")
    if len(prefix) > 253 or len(name) > 63:
        raise ValueError(f"{shown(value)} {LABEL_KEY.message}")
    return value


MODEL_NAME = Rule("^[A-Za-z0-9_./][-A-Za-z0-9_./:@+]*$", 256,
                  "must be a model name as vLLM serves it (e.g. Qwen/Qwen3-32B): letters, "
                  "digits and . _ / : @ + -, starting with a letter, digit, '.', '_' or '/'")

# The shared volume gets a directory of its own under one of these: anywhere else it could
# shadow what the model server's image keeps there (its code, working directory, site
# packages, system files), and whoever can write the volume could plant files in it.
MOUNT_PATH_ROOTS = ("/mnt", "/data", "/cache", "/scratch")
_SEGMENT = "([-A-Za-z0-9_]|[.][-A-Za-z0-9_]|[.][.][-A-Za-z0-9_.])[-A-Za-z0-9_.]*"
MOUNT_PATH = Rule(
    f"^(/|(/{_SEGMENT})+)$", 512,
    "must be an absolute, normalised path of letters, digits, '.', '_', '-' and '/' (no "
    "'//', '.' or '..' segment, trailing '/', space, quote, '$' or other shell character), "
    "e.g. /mnt/files-storage")
MOUNT_PATH_PLACE = Rule(
    "^/(" + "|".join(r.lstrip("/") for r in MOUNT_PATH_ROOTS) + ")/.+$", 512,
    "would shadow what the model server's image keeps there (its code, working directory "
    "or system files): use a directory of its own under " + ", ".join(
        r + "/" for r in MOUNT_PATH_ROOTS) + " such as /mnt/files-storage")

SECRET_NAME = dns_subdomain("Secret name")
SECRET_KEY = Rule("^[-._a-zA-Z0-9]+$", 253,
                  "must be a Secret key: letters, digits, dashes, dots and underscores")
# A host directory for the local-disk tier: absolute and normalised like a mount path
# (it reaches the pod spec only, never a shell); where it may be is the admin's choice
# (the Helm value localDisk.allowedHostPaths), checked by validation/host_paths.py.
HOST_PATH = Rule(
    f"^(/{_SEGMENT})+$", 512,
    "must be an absolute, normalised host directory of letters, digits, '.', '_', '-' and "
    "'/' (not '/', no '//', '.' or '..' segment, trailing '/' or shell character), e.g. "
    "/mnt/nvme/kvtier")
# S3 bucket names (the AWS rules, which S3-compatible stores follow): 3 to 63 lowercase
# letters, digits, '.' and '-', starting and ending with a letter or digit.
BUCKET_NAME = Rule("^[a-z0-9][-.a-z0-9]{1,61}[a-z0-9]$", 63,
                   "must be an S3 bucket name: 3 to 63 lowercase letters, digits, '.' and "
                   "'-', starting and ending with a letter or digit")
# Where the tier's objects go in the bucket: '/'-separated segments of safe characters.
OBJECT_PREFIX = Rule(
    "^[A-Za-z0-9_-][-A-Za-z0-9_.]*(/[A-Za-z0-9_-][-A-Za-z0-9_.]*)*$", 200,
    "must be an object key prefix of '/'-separated segments of letters, digits, '.', '_' "
    "and '-' (no leading, trailing or double '/', no segment starting with '.'), e.g. "
    "kvtier/v1")
ENDPOINT_URL = Rule(
    "^https?://[A-Za-z0-9]([-.A-Za-z0-9]{0,251}[A-Za-z0-9])?(:[0-9]{1,5})?$", 280,
    "must be http(s)://<host>[:<port>] with no path, e.g. https://rgw.storage.svc:443")
REGION = Rule("^[a-z0-9][-a-z0-9]{0,62}$", 63,
              "must be a region name: lowercase letters, digits and '-', e.g. us-east-1")
