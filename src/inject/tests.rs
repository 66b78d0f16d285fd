use super::*;

/// A template shaped as the chart renders it.
fn template() -> Value {
    json!({
        "container": {
            "name": "leasehold-sidecar",
            "image": "leasehold:0.1.0",
            "restartPolicy": "Always",
            "args": ["sidecar"],
            "env": [
                {"name": "LEASEHOLD_LISTEN", "value": "127.0.0.1:7070"},
                {"name": "LEASEHOLD_QUEUE", "value": "placeholder"},
            ],
            "resources": {"requests": {"cpu": "20m", "memory": "24Mi"}, "limits": {"memory": "64Mi"}},
            "volumeMounts": [{"name": "leasehold-dispatcher-token", "mountPath": "/var/run/secrets/leasehold.dev/dispatcher"}],
        },
        "volumes": [{"name": "leasehold-dispatcher-token", "projected": {"sources": [
            {"serviceAccountToken": {"audience": "leasehold-dispatcher", "path": "token"}}
        ]}}],
        "serviceAccountName": "leasehold-worker",
        "workerEnv": [{"name": "LEASEHOLD_SIDECAR", "value": "http://127.0.0.1:7070"}],
    })
}

fn sidecar() -> Sidecar {
    Sidecar::from_json(template().to_string().as_bytes()).unwrap()
}

fn pod(annotations: Value, spec: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "worker-7d9-", "namespace": "jobs", "annotations": annotations},
        "spec": spec,
    })
}

fn request(operation: &str, kind: &str, object: &Value) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": kind},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "jobs",
            "operation": operation,
            "object": object,
        }
    })
}

fn decide_on(object: &Value) -> Reviewed {
    review(
        request("CREATE", "Pod", object).to_string().as_bytes(),
        &sidecar(),
    )
    .unwrap()
}

/// The pod after the answer's patch, as the API server would store it.
fn patched(object: &Value, reviewed: &Reviewed) -> Value {
    let response = &reviewed.response["response"];
    assert_eq!(response["allowed"], true, "{response}");
    assert_eq!(response["patchType"], "JSONPatch");
    let text = base64::engine::general_purpose::STANDARD
        .decode(response["patch"].as_str().unwrap())
        .unwrap();
    let patch: json_patch::Patch = serde_json::from_slice(&text).unwrap();
    let mut pod = object.clone();
    json_patch::patch(&mut pod, &patch).unwrap();
    pod
}

fn env_of(container: &Value, name: &str) -> Vec<Value> {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == name)
        .map(|e| e["value"].clone())
        .collect()
}

#[test]
fn an_annotated_pod_gets_the_sidecar_its_volumes_its_account_and_the_workers_env() {
    let object = pod(
        json!({"leasehold.dev/queue": "transcribe"}),
        json!({"serviceAccountName": "default", "serviceAccount": "default",
               "containers": [{"name": "worker", "image": "w"}, {"name": "uploader", "image": "u"}]}),
    );
    let reviewed = decide_on(&object);
    assert!(
        matches!(&reviewed.decision, Decision::Injected { pod, queue, .. }
        if pod == "jobs/worker-7d9-*" && queue == "transcribe")
    );
    let pod = patched(&object, &reviewed);
    let init = pod["spec"]["initContainers"].as_array().unwrap();
    assert_eq!(init.len(), 1);
    let sidecar = &init[0];
    assert_eq!(sidecar["name"], "leasehold-sidecar");
    assert_eq!(sidecar["restartPolicy"], "Always");
    assert_eq!(
        env_of(sidecar, "LEASEHOLD_QUEUE"),
        vec![json!("transcribe")]
    );
    assert_eq!(
        env_of(sidecar, "LEASEHOLD_LISTEN"),
        vec![json!("127.0.0.1:7070")]
    );
    assert_eq!(sidecar["resources"]["requests"]["cpu"], "20m");
    assert_eq!(
        pod["spec"]["volumes"][0]["name"],
        "leasehold-dispatcher-token"
    );
    for c in pod["spec"]["containers"].as_array().unwrap() {
        assert_eq!(
            env_of(c, "LEASEHOLD_SIDECAR"),
            vec![json!("http://127.0.0.1:7070")]
        );
    }
    assert_eq!(pod["spec"]["serviceAccountName"], "leasehold-worker");
    assert_eq!(pod["spec"]["serviceAccount"], "leasehold-worker");
    assert_eq!(
        pod["metadata"]["annotations"][INJECTED_ANNOTATION],
        env!("CARGO_PKG_VERSION")
    );
}

#[test]
fn what_the_pod_has_is_kept_and_appended_to() {
    let object = pod(
        json!({"leasehold.dev/queue": "q"}),
        json!({
            "serviceAccountName": "custom-worker",
            "initContainers": [{"name": "fetch-model", "image": "f"}],
            "volumes": [{"name": "models", "emptyDir": {}}],
            "containers": [
                {"name": "worker", "image": "w", "env": [{"name": "LEASEHOLD_SIDECAR", "value": "http://127.0.0.1:9999"}]},
                {"name": "other", "image": "o", "env": [{"name": "A", "value": "1"}]},
            ],
        }),
    );
    let pod = patched(&object, &decide_on(&object));
    let init = pod["spec"]["initContainers"].as_array().unwrap();
    assert_eq!(
        init[0]["name"], "fetch-model",
        "the pod's own init containers run first"
    );
    assert_eq!(init[1]["name"], "leasehold-sidecar");
    let volumes: Vec<&Value> = pod["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| &v["name"])
        .collect();
    assert_eq!(
        volumes,
        [&json!("models"), &json!("leasehold-dispatcher-token")]
    );
    let containers = pod["spec"]["containers"].as_array().unwrap();
    assert_eq!(
        env_of(&containers[0], "LEASEHOLD_SIDECAR"),
        vec![json!("http://127.0.0.1:9999")],
        "a container's own value wins"
    );
    assert_eq!(env_of(&containers[1], "A"), vec![json!("1")]);
    assert_eq!(
        env_of(&containers[1], "LEASEHOLD_SIDECAR"),
        vec![json!("http://127.0.0.1:7070")]
    );
    assert_eq!(pod["spec"]["serviceAccountName"], "custom-worker");
}

#[test]
fn resource_annotations_set_the_sidecars_resources() {
    let object = pod(
        json!({
            "leasehold.dev/queue": "q",
            "leasehold.dev/sidecar-cpu-request": "100m",
            "leasehold.dev/sidecar-cpu-limit": "1",
            "leasehold.dev/sidecar-memory-request": "48Mi",
            "leasehold.dev/sidecar-memory-limit": "0.25Gi",
        }),
        json!({"containers": [{"name": "worker", "image": "w"}]}),
    );
    let pod = patched(&object, &decide_on(&object));
    let resources = &pod["spec"]["initContainers"][0]["resources"];
    assert_eq!(
        resources,
        &json!({"requests": {"cpu": "100m", "memory": "48Mi"}, "limits": {"cpu": "1", "memory": "0.25Gi"}})
    );
}

fn refusal(reviewed: &Reviewed) -> Refusal {
    let response = &reviewed.response["response"];
    assert_eq!(response["allowed"], false);
    assert_eq!(response["status"]["code"], 422);
    assert!(response.get("patch").is_none());
    match &reviewed.decision {
        Decision::Refused(r) => {
            assert_eq!(response["status"]["message"], r.to_string());
            r.clone()
        }
        other => panic!("not refused: {other:?}"),
    }
}

#[test]
fn bad_annotations_and_clashing_volumes_are_refused_naming_them() {
    let spec = json!({"containers": [{"name": "worker", "image": "w"}]});
    let cases = [
        (
            json!({"leasehold.dev/queue": "Transcribe_Fast"}),
            spec.clone(),
            "annotation leasehold.dev/queue",
            "Transcribe_Fast",
            "DNS label",
        ),
        (
            json!({"leasehold.dev/queue": ""}),
            spec.clone(),
            "annotation leasehold.dev/queue",
            "",
            "DNS label",
        ),
        (
            json!({"leasehold.dev/queue": "q", "leasehold.dev/sidecar-memory-limit": "64 MB"}),
            spec.clone(),
            "annotation leasehold.dev/sidecar-memory-limit",
            "64 MB",
            "quantity",
        ),
        (
            json!({"leasehold.dev/queue": "q", "leasehold.dev/sidecar-cpu-request": "-1"}),
            spec.clone(),
            "annotation leasehold.dev/sidecar-cpu-request",
            "-1",
            "quantity",
        ),
        (
            json!({"leasehold.dev/queue": "q"}),
            json!({"containers": [{"name": "worker", "image": "w"}], "volumes": [{"name": "leasehold-dispatcher-token", "emptyDir": {}}]}),
            "volume",
            "leasehold-dispatcher-token",
            "rename",
        ),
    ];
    for (annotations, spec, what, value, rule) in cases {
        let r = refusal(&decide_on(&pod(annotations, spec)));
        assert_eq!(r.pod, "jobs/worker-7d9-*");
        assert_eq!(r.what, what);
        assert_eq!(r.value, value);
        assert!(r.rule.contains(rule), "{r}");
        assert!(r.to_string().starts_with("pod jobs/worker-7d9-*: "), "{r}");
    }
}

#[test]
fn pods_not_asking_or_already_carrying_a_sidecar_are_left_alone() {
    let plain = pod(json!({"team": "a"}), json!({"containers": [{"name": "w"}]}));
    let carrying = pod(
        json!({"leasehold.dev/queue": "q"}),
        json!({"initContainers": [{"name": "leasehold-sidecar"}], "containers": [{"name": "w"}]}),
    );
    let mut unannotated = plain.clone();
    unannotated["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("annotations");
    let annotated = pod(
        json!({"leasehold.dev/queue": "q"}),
        json!({"containers": [{"name": "w"}]}),
    );
    let cases = [
        (request("CREATE", "Pod", &plain), Decision::NotAsked),
        (request("CREATE", "Pod", &unannotated), Decision::NotAsked),
        (request("CREATE", "Pod", &carrying), Decision::AlreadyThere),
        (request("UPDATE", "Pod", &annotated), Decision::NotAsked),
        (
            request("CREATE", "ConfigMap", &annotated),
            Decision::NotAsked,
        ),
    ];
    for (body, expected) in cases {
        let reviewed = review(body.to_string().as_bytes(), &sidecar()).unwrap();
        assert_eq!(reviewed.decision, expected);
        assert_eq!(
            reviewed.response,
            json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                   "response": {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002", "allowed": true}})
        );
    }
}

#[test]
fn a_body_that_is_not_a_review_is_an_error() {
    assert!(matches!(
        review(b"[]", &sidecar()),
        Err(ReviewError::NotAReview(_))
    ));
    assert!(matches!(
        review(br#"{"apiVersion": "admission.k8s.io/v1"}"#, &sidecar()),
        Err(ReviewError::NoRequest)
    ));
}

#[test]
fn bad_templates_are_refused_naming_the_field() {
    let with = |pointer: &str, value: Value| {
        let mut t = template();
        *t.pointer_mut(pointer).unwrap() = value;
        Sidecar::from_json(t.to_string().as_bytes())
            .unwrap_err()
            .to_string()
    };
    let e = with("/container/name", json!("sidecar"));
    assert!(
        e.contains("container.name is \"sidecar\": must be leasehold-sidecar"),
        "{e}"
    );
    let e = with("/container/restartPolicy", json!("OnFailure"));
    assert!(
        e.contains("container.restartPolicy is \"OnFailure\": must be Always"),
        "{e}"
    );
    let e = with("/serviceAccountName", json!("Leasehold Worker"));
    assert!(
        e.contains("serviceAccountName is \"Leasehold Worker\""),
        "{e}"
    );
    let e = with(
        "/volumes",
        json!([{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]),
    );
    assert!(
        e.contains("volumes[].name is \"a\": must be distinct"),
        "{e}"
    );
    let mut t = template();
    t["sidecars"] = json!([]);
    let e = Sidecar::from_json(t.to_string().as_bytes())
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown field `sidecars`"), "{e}");
    let mut t = template();
    t.as_object_mut().unwrap().remove("container");
    let e = Sidecar::from_json(t.to_string().as_bytes())
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing field `container`"), "{e}");
    let e = Sidecar::load(Path::new("/nonexistent/sidecar.json"))
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "cannot read the sidecar template /nonexistent/sidecar.json"
    );
}

#[test]
fn quantities_follow_kubernetes_grammar() {
    for good in [
        "1", "0.5", ".5", "100m", "64Mi", "1Gi", "2G", "1e3", "1E-2", "+1", "12345678", "5.",
    ] {
        assert!(is_quantity(good), "{good}");
    }
    for bad in [
        "", "-1", "64 MB", "64MB", "Mi", "1.2.3", "1e", "0x10", "1mi", "abc", ".",
    ] {
        assert!(!is_quantity(bad), "{bad}");
    }
}
