"""spec.selector: which pods a cache selects (the Kubernetes LabelSelector, bounded)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from kvtier_operator.api.v1alpha1.fields import ApiModel, LabelKey, LabelValue, MapLabelKey

# A selector names a handful of labels; these bounds keep the webhook's overlap check
# (every other cache in the namespace) and the CRD's rule costs small.
MAX_SELECTOR_TERMS = 32
MAX_SELECTOR_VALUES = 64

# NotIn, Exists and DoesNotExist alone select (nearly) every pod of the namespace, as `{}`
# does; a cache must name the pods it wants by at least one label value.
NEEDS_EQUALITY = (
    "the selector must name its pods by at least one label value: set matchLabels "
    "(e.g. llm-d.ai/role: decode) or a matchExpressions term with operator In; "
    "NotIn, Exists and DoesNotExist alone select nearly every pod"
)


class LabelSelectorRequirement(ApiModel):
    key: LabelKey = Field(description="Label key the requirement applies to.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="In, NotIn, Exists or DoesNotExist."
    )
    values: list[LabelValue] | None = Field(
        default=None,
        max_length=MAX_SELECTOR_VALUES,
        description="Values for In and NotIn; must be empty for Exists and DoesNotExist.",
    )

    @model_validator(mode="after")
    def _values_match_operator(self) -> LabelSelectorRequirement:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs at least one value in values")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no values; remove values")
        return self


class LabelSelector(ApiModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "(has(self.matchLabels) && size(self.matchLabels) > 0)"
                    " || (has(self.matchExpressions)"
                    " && self.matchExpressions.exists(e, e.operator == 'In'))",
                    "message": NEEDS_EQUALITY,
                }
            ]
        }
    )
    match_labels: dict[MapLabelKey, LabelValue] | None = Field(
        default=None, max_length=MAX_SELECTOR_TERMS,
        description="Pods whose labels contain all of these key/value pairs."
    )
    match_expressions: list[LabelSelectorRequirement] | None = Field(
        default=None, max_length=MAX_SELECTOR_TERMS,
        description="Set-based label requirements; all must hold."
    )

    @model_validator(mode="after")
    def _has_equality(self) -> LabelSelector:
        if not self.match_labels and not any(
            req.operator == "In" for req in self.match_expressions or []
        ):
            raise ValueError(NEEDS_EQUALITY)
        return self

    def query(self) -> str:
        """The selector in the API's labelSelector syntax."""
        terms = [f"{k}={v}" for k, v in sorted((self.match_labels or {}).items())]
        for req in self.match_expressions or []:
            values = ",".join(req.values or [])
            terms.append({"In": f"{req.key} in ({values})",
                          "NotIn": f"{req.key} notin ({values})",
                          "Exists": req.key, "DoesNotExist": f"!{req.key}"}[req.operator])
        return ",".join(terms)

    def matches(self, labels: dict[str, str]) -> bool:
        for key, value in (self.match_labels or {}).items():
            if labels.get(key) != value:
                return False
        for req in self.match_expressions or []:
            present = req.key in labels
            if req.operator == "In" and labels.get(req.key) not in (req.values or []):
                return False
            if req.operator == "NotIn" and present and labels[req.key] in (req.values or []):
                return False
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
        return True

