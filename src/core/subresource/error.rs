//! A failed request's answer: the status code and a `metav1.Status` body,
//! as every Kubernetes API server (and virt-api) writes them.

use serde_json::{json, Value};

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code} {reason}: {message}")]
pub struct ApiError {
    pub code: u16,
    /// `metav1.StatusReason`: NotFound, Conflict, Forbidden, ...
    pub reason: &'static str,
    pub message: String,
    /// The object it is about (`details`): its kind and name.
    pub object: Option<(&'static str, String)>,
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            object: None,
        }
    }

    fn about(mut self, kind: &'static str, name: &str) -> Self {
        self.object = Some((kind, name.to_owned()));
        self
    }

    pub fn not_found_path(path: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("the server could not find the requested resource {path}"),
        )
    }

    /// As the API server words it: `virtualmachine.kubevirt.io "x" not found`.
    pub fn not_found(kind: &'static str, name: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("{kind}.kubevirt.io \"{name}\" not found"),
        )
        .about(kind, name)
    }

    /// `Operation cannot be fulfilled on <kind>.kubevirt.io "<name>": <why>`
    pub fn conflict_on(kind: &'static str, name: &str, why: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!("Operation cannot be fulfilled on {kind}.kubevirt.io \"{name}\": {why}"),
        )
        .about(kind, name)
    }

    pub fn method_not_allowed(method: &str) -> Self {
        Self::new(
            405,
            "MethodNotAllowed",
            format!("the server does not allow this method on the requested resource: {method}"),
        )
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(409, "Conflict", message)
    }

    pub fn unauthorized() -> Self {
        Self::new(401, "Unauthorized", "Unauthorized")
    }

    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(403, "Forbidden", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            500,
            "InternalError",
            format!("Internal error occurred: {}", message.into()),
        )
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(503, "ServiceUnavailable", message)
    }

    /// The `Status` object of the body.
    pub fn status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some((kind, name)) = &self.object {
            s["details"] = json!({"name": name, "group": "kubevirt.io", "kind": kind});
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_body_carries_code_reason_and_message() {
        let s = ApiError::conflict("VMI is not running").status();
        assert_eq!(s["kind"], "Status");
        assert_eq!(s["status"], "Failure");
        assert_eq!(s["code"], 409);
        assert_eq!(s["reason"], "Conflict");
        assert_eq!(s["message"], "VMI is not running");
        assert!(s.get("details").is_none());
        let s = ApiError::conflict_on("virtualmachineinstance", "vm1", "VMI is already paused")
            .status();
        assert_eq!(
            s["message"],
            "Operation cannot be fulfilled on virtualmachineinstance.kubevirt.io \"vm1\": VMI is already paused"
        );
        assert_eq!(s["details"]["kind"], "virtualmachineinstance");
        assert_eq!(
            ApiError::not_found("virtualmachine", "x").message,
            "virtualmachine.kubevirt.io \"x\" not found"
        );
    }
}
