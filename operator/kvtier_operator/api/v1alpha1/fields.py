"""The field types of the TieredPrefixCache API: the base model, sizes (Quantity) and
the strings under rules (api/rules.py), each paired with the CRD schema that says the same.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeAlias

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, WithJsonSchema
from pydantic.alias_generators import to_camel

from kvtier_operator.api import rules
from kvtier_operator.api.cron import SCHEDULE
from kvtier_operator.api.quantity import (
    CR_MAX_INT,
    CR_MAX_LENGTH,
    CR_QUANTITY_REGEX,
    normalize_quantity,
)
from kvtier_operator.api.rules import Rule

# spec.storage.storeNice and spec.localDisk.storeNice: what kvtier's backend does with it.
STORE_NICE_DESCRIPTION = (
    "kvtier's backend only: how much lower than the engine's the CPU priority (nice "
    "value) of the threads that write blocks is, so that background stores yield the CPU "
    "to the model server's own prefill (inside the pod: nice weighs only against the "
    "pod's own processes); loads keep the engine's priority. Default 10; 0: stores and "
    "loads share threads at the engine's priority.")

# A size: checked against a bounded grammar before any conversion (see quantity.py). The
# CRD carries the same grammar as a pattern: a CEL rule on an int-or-string field would
# be costed as a 3 MB string, which the API server refuses.
Quantity: TypeAlias = Annotated[
    str,
    BeforeValidator(normalize_quantity),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "maxLength": CR_MAX_LENGTH,
                    "pattern": CR_QUANTITY_REGEX, "minimum": 1, "maximum": CR_MAX_INT}),
]


def rule_schema(*field_rules: Rule) -> WithJsonSchema:
    """The CRD schema of a string field under `field_rules`: the rules as CEL rules with
    the same messages (and the strictest maxLength). The field's type pairs it with one
    AfterValidator per rule, so the model checks what the API server checks."""
    return WithJsonSchema({
        "type": "string", "maxLength": min(r.max_length for r in field_rules),
        "x-kubernetes-validations": [r.cel() for r in field_rules]})


def item_schema(rule: Rule) -> WithJsonSchema:
    """The CRD schema of a string in a list or map: pattern and maxLength (a CEL rule there
    is costed per item); the field's type pairs it with the model's check of the rule."""
    return WithJsonSchema({"type": "string", **rule.pattern_schema()})


# String fields under rules (rules.py): static types, so type checkers see `str`.
ModelName: TypeAlias = Annotated[
    str, AfterValidator(rules.MODEL_NAME.check), rule_schema(rules.MODEL_NAME)]
StorageClassName: TypeAlias = Annotated[
    str, AfterValidator(rules.STORAGE_CLASS_NAME.check), rule_schema(rules.STORAGE_CLASS_NAME)]
ClaimName: TypeAlias = Annotated[
    str, AfterValidator(rules.CLAIM_NAME.check), rule_schema(rules.CLAIM_NAME)]
MountPath: TypeAlias = Annotated[
    str, AfterValidator(rules.MOUNT_PATH.check), AfterValidator(rules.MOUNT_PATH_PLACE.check),
    rule_schema(rules.MOUNT_PATH, rules.MOUNT_PATH_PLACE)]
Schedule: TypeAlias = Annotated[str, AfterValidator(SCHEDULE.check), rule_schema(SCHEDULE)]
ZmqEndpoint: TypeAlias = Annotated[
    str, AfterValidator(rules.ZMQ_ENDPOINT.check), rule_schema(rules.ZMQ_ENDPOINT)]
ConfigMapName: TypeAlias = Annotated[
    str, AfterValidator(rules.CONFIG_MAP_NAME.check), rule_schema(rules.CONFIG_MAP_NAME)]
ContainerName: TypeAlias = Annotated[
    str, AfterValidator(rules.CONTAINER_NAME.check), rule_schema(rules.CONTAINER_NAME)]
ServiceName: TypeAlias = Annotated[
    str, AfterValidator(rules.SERVICE_NAME.check), rule_schema(rules.SERVICE_NAME)]
DaemonSetName: TypeAlias = Annotated[
    str, AfterValidator(rules.DAEMON_SET_NAME.check), rule_schema(rules.DAEMON_SET_NAME)]
ResourceName: TypeAlias = Annotated[
    str, AfterValidator(rules.RESOURCE_NAME.check), rule_schema(rules.RESOURCE_NAME)]
Namespace: TypeAlias = Annotated[
    str, AfterValidator(rules.NAMESPACE.check), rule_schema(rules.NAMESPACE)]
ConfigMapKey: TypeAlias = Annotated[
    str, AfterValidator(rules.CONFIG_MAP_KEY.check), rule_schema(rules.CONFIG_MAP_KEY)]
SecretName: TypeAlias = Annotated[
    str, AfterValidator(rules.SECRET_NAME.check), rule_schema(rules.SECRET_NAME)]
SecretKey: TypeAlias = Annotated[
    str, AfterValidator(rules.SECRET_KEY.check), rule_schema(rules.SECRET_KEY)]
HostPath: TypeAlias = Annotated[
    str, AfterValidator(rules.HOST_PATH.check), rule_schema(rules.HOST_PATH)]
BucketName: TypeAlias = Annotated[
    str, AfterValidator(rules.BUCKET_NAME.check), rule_schema(rules.BUCKET_NAME)]
ObjectPrefix: TypeAlias = Annotated[
    str, AfterValidator(rules.OBJECT_PREFIX.check), rule_schema(rules.OBJECT_PREFIX)]
EndpointUrl: TypeAlias = Annotated[
    str, AfterValidator(rules.ENDPOINT_URL.check), rule_schema(rules.ENDPOINT_URL)]
Region: TypeAlias = Annotated[
    str, AfterValidator(rules.REGION.check), rule_schema(rules.REGION)]

LabelKey: TypeAlias = Annotated[
    str, AfterValidator(rules.check_label_key), item_schema(rules.LABEL_KEY)]
LabelValue: TypeAlias = Annotated[
    str, AfterValidator(rules.LABEL_VALUE.check), item_schema(rules.LABEL_VALUE)]
# Map keys cannot carry a schema in a CRD; the model checks them.
MapLabelKey: TypeAlias = Annotated[str, AfterValidator(rules.check_label_key)]

# Enum strings the CRD's CEL rules concatenate: a bound keeps the API server's cost
# estimate small (an unbounded string is costed as the largest request).
ENUM_BOUND: dict[str, Any] = {"maxLength": 32}


class ApiModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_enum_values=True,
    )
