#!/usr/bin/env node
// Checks Kubernetes manifests as rendered by `kubectl kustomize` (scripts/validate_k8s.sh runs
// it on every kustomization under deploy/k8s):
//
//   node tests/k8s/validate.js [--label NAME] RENDERED.yaml
//       every document against the Kubernetes schema of its kind (npm kubernetes-models; a kind
//       it does not know is an error), fields the schema does not know (a misspelled optional
//       field passes the schema alone), then what no schema sees: references between documents,
//       ports, $(VAR)s, Strata's cluster file and shared tier's nodes (and that NetworkPolicies
//       let the processes given --shared_tier reach them), and the house rules (non-root,
//       read-only root file system, requests and limits). One line "ok ..." or "FAIL ..." and
//       the errors.
//   node tests/k8s/validate.js --kustomization DIR
//       DIR/kustomization.yaml uses only what kustomize v2.0.3 (Debian's kubectl 1.20) reads.
//   node tests/k8s/validate.js --expect-reject FILE_OR_DIR...
//       each FILE (rendered documents) or DIR (a kustomization) must be rejected, with errors
//       containing each of its "# expect: TEXT" lines: the check that the checks can fail.
//
// Exit status 0 when everything passed, 1 otherwise, 2 for bad usage.
'use strict';

const fs = require('fs');
const path = require('path');
const YAML = require('yaml');

// ---- schemas ------------------------------------------------------------------------------------

// The kubernetes-models class of apiVersion + kind, or null for a kind it does not have.
function modelOf(apiVersion, kind) {
  if (typeof apiVersion !== 'string' || typeof kind !== 'string') return null;
  if (!/^([a-z0-9.-]+\/)?v[0-9]+((alpha|beta)[0-9]+)?$/.test(apiVersion)) return null;
  if (!/^[A-Z][A-Za-z0-9]*$/.test(kind)) return null;
  let mod;
  try {
    mod = require(`kubernetes-models/${apiVersion}/${kind}`);
  } catch (e) {
    if (e.code === 'MODULE_NOT_FOUND' || e.code === 'ERR_PACKAGE_PATH_NOT_EXPORTED') return null;
    throw e;
  }
  const model = mod[kind];
  // Only top-level kinds: apps/v1/DeploymentSpec is a module too, but not a kind.
  if (!model || model.kind !== kind || model.apiVersion !== apiVersion) return null;
  return model;
}

// Validates `doc` with the model's generated validator through a proxy that records every
// property the validator reads. The validator reads every property its schema defines (present
// or not) and every key of a map, so a key it never read, in an object where it read anything,
// is a field the schema does not have. Objects it read nothing of are free-form: left alone.
function unknownFields(model, doc) {
  const tracked = []; // {target, where, read: Set}
  const proxies = new WeakMap();
  const wrap = (target, where) => {
    if (proxies.has(target)) return proxies.get(target);
    const entry = { target, where, read: new Set() };
    tracked.push(entry);
    const proxy = new Proxy(target, {
      get(t, p) {
        if (typeof p === 'string') entry.read.add(p);
        const v = t[p];
        if (typeof p === 'string' && v !== null && typeof v === 'object') {
          return wrap(v, Array.isArray(t) ? `${where}[${p}]` : where ? `${where}.${p}` : p);
        }
        return v;
      },
      has(t, p) {
        if (typeof p === 'string') entry.read.add(p);
        return p in t;
      },
    });
    proxies.set(target, proxy);
    return proxy;
  };
  try {
    model.prototype.validate.call(wrap(doc, ''));
  } catch (e) {
    // Schema errors are reported by the plain validation.
  }
  const unknown = [];
  for (const { target, where, read } of tracked) {
    if (Array.isArray(target) || read.size === 0) continue;
    for (const key of Object.keys(target)) {
      if (!read.has(key)) unknown.push(where ? `${where}.${key}` : key);
    }
  }
  return unknown;
}

function schemaErrors(doc) {
  const model = modelOf(doc.apiVersion, doc.kind);
  if (model === null) {
    return [
      `unknown kind ${doc.kind} (apiVersion ${doc.apiVersion}): no schema to check it ` +
        `against (kubernetes-models has none)`,
    ];
  }
  if (doc.kind === 'Secret' && doc.data && typeof doc.data === 'object') {
    // Newer kustomize folds long base64 values over lines; the API server's decoder skips line
    // breaks, the schema's "byte" format does not.
    doc = {
      ...doc,
      data: Object.fromEntries(
        Object.entries(doc.data).map(([k, v]) => [
          k,
          typeof v === 'string' ? v.replace(/[\r\n]/g, '') : v,
        ]),
      ),
    };
  }
  try {
    new model(doc).validate();
  } catch (e) {
    return [`schema: ${e.message}`];
  }
  return unknownFields(model, doc).map((f) => `schema: unknown field ${f}`);
}

// ---- label selectors ----------------------------------------------------------------------------

// Whether `labels` satisfy a LabelSelector ({matchLabels, matchExpressions}).
function selects(selector, labels) {
  labels = labels || {};
  for (const [k, v] of Object.entries((selector && selector.matchLabels) || {})) {
    if (labels[k] !== v) return false;
  }
  for (const e of (selector && selector.matchExpressions) || []) {
    const has = Object.prototype.hasOwnProperty.call(labels, e.key);
    const values = e.values || [];
    if (e.operator === 'In' && !(has && values.includes(labels[e.key]))) return false;
    if (e.operator === 'NotIn' && has && values.includes(labels[e.key])) return false;
    if (e.operator === 'Exists' && !has) return false;
    if (e.operator === 'DoesNotExist' && has) return false;
  }
  return true;
}

// A Service's selector is a plain map.
const selectsMap = (map, labels) => selects({ matchLabels: map }, labels);

// ---- the rendered set ---------------------------------------------------------------------------

const nsOf = (doc) => (doc.metadata && doc.metadata.namespace) || '';
const nameOf = (doc) => (doc.metadata && doc.metadata.name) || '';
const idOf = (doc) => `${doc.kind}/${nameOf(doc) || '?'}`;

// Every pod template in the set: {doc, ns, labels, annotations, spec, claims (StatefulSet
// volumeClaimTemplates' names), where}.
function podTemplates(docs) {
  const out = [];
  for (const doc of docs) {
    let template = null;
    let where = 'spec.template';
    if (['Deployment', 'StatefulSet', 'DaemonSet', 'ReplicaSet', 'Job'].includes(doc.kind)) {
      template = doc.spec && doc.spec.template;
    } else if (doc.kind === 'CronJob') {
      template =
        doc.spec &&
        doc.spec.jobTemplate &&
        doc.spec.jobTemplate.spec &&
        doc.spec.jobTemplate.spec.template;
      where = 'spec.jobTemplate.spec.template';
    } else if (doc.kind === 'Pod') {
      template = doc;
      where = '';
    }
    if (!template || !template.spec) continue;
    const claims =
      doc.kind === 'StatefulSet'
        ? ((doc.spec && doc.spec.volumeClaimTemplates) || []).map(nameOf)
        : [];
    out.push({
      doc,
      ns: nsOf(doc),
      where,
      spec: template.spec,
      claims,
      labels: (template.metadata && template.metadata.labels) || {},
      annotations: (template.metadata && template.metadata.annotations) || {},
    });
  }
  return out;
}

function find(docs, kind, ns, name) {
  return docs.find((d) => d.kind === kind && nsOf(d) === ns && nameOf(d) === name);
}

// The keys of a ConfigMap or Secret.
function keysOf(doc) {
  const keys = new Set();
  for (const field of ['data', 'binaryData', 'stringData']) {
    for (const k of Object.keys(doc[field] || {})) keys.add(k);
  }
  return keys;
}

// The text of a ConfigMap's or Secret's key.
function valueOf(doc, key) {
  if (doc.kind === 'Secret') {
    if (doc.stringData && key in doc.stringData) return String(doc.stringData[key]);
    if (doc.data && key in doc.data) return Buffer.from(String(doc.data[key]), 'base64').toString();
    return null;
  }
  if (doc.data && key in doc.data) return String(doc.data[key]);
  return null;
}

// ---- cross-references ---------------------------------------------------------------------------

function crossReferenceErrors(docs) {
  const errors = [];
  const err = (doc, where, what) =>
    errors.push(`${idOf(doc)}: ${where ? where + ': ' : ''}${what}`);
  const pods = podTemplates(docs);

  // Names: present and unique per kind and namespace.
  const seen = new Set();
  for (const doc of docs) {
    if (!nameOf(doc)) {
      err(doc, 'metadata.name', 'missing');
      continue;
    }
    const key = `${doc.kind}/${nsOf(doc)}/${nameOf(doc)}`;
    if (seen.has(key)) err(doc, 'metadata.name', 'defined twice');
    seen.add(key);
  }

  // A workload's selector must select its own pods (the API server refuses it otherwise).
  for (const p of pods) {
    if (p.doc.kind === 'Pod' || p.doc.kind === 'CronJob' || p.doc.kind === 'Job') continue;
    const selector = p.doc.spec.selector;
    if (!selector || !selects(selector, p.labels)) {
      err(
        p.doc,
        'spec.selector',
        `does not select the pod template's labels ${JSON.stringify(p.labels)}`,
      );
    }
  }

  // Services select pods, and their target ports are ports those pods declare.
  for (const svc of docs.filter((d) => d.kind === 'Service')) {
    const spec = svc.spec || {};
    if (spec.type === 'ExternalName') continue;
    if (!spec.selector || Object.keys(spec.selector).length === 0) {
      err(svc, 'spec.selector', 'missing: the Service would select no pod');
      continue;
    }
    const matched = pods.filter((p) => p.ns === nsOf(svc) && selectsMap(spec.selector, p.labels));
    if (matched.length === 0) {
      err(svc, 'spec.selector', `${JSON.stringify(spec.selector)} matches no workload's pods`);
      continue;
    }
    for (const port of spec.ports || []) {
      const target = port.targetPort === undefined ? port.port : port.targetPort;
      for (const p of matched) {
        const declared = (p.spec.containers || []).some((c) =>
          (c.ports || []).some((cp) =>
            typeof target === 'string' ? cp.name === target : cp.containerPort === target,
          ),
        );
        if (!declared) {
          err(
            svc,
            `spec.ports[${port.name || port.port}].targetPort`,
            `${target} is not a port of ${idOf(p.doc)}'s containers`,
          );
        }
      }
    }
  }

  // A StatefulSet's serviceName is a headless Service that selects its pods.
  for (const p of pods.filter((q) => q.doc.kind === 'StatefulSet')) {
    const name = p.doc.spec.serviceName;
    const svc = name && find(docs, 'Service', p.ns, name);
    if (!svc) {
      err(p.doc, 'spec.serviceName', `Service '${name}' is not in the render`);
    } else if ((svc.spec || {}).clusterIP !== 'None') {
      err(p.doc, 'spec.serviceName', `Service '${name}' is not headless (clusterIP: None)`);
    } else if (!selectsMap(svc.spec.selector, p.labels)) {
      err(p.doc, 'spec.serviceName', `Service '${name}' does not select this StatefulSet's pods`);
    }
  }

  // Disruption budgets and network policies select pods that exist.
  for (const pdb of docs.filter((d) => d.kind === 'PodDisruptionBudget')) {
    const sel = (pdb.spec || {}).selector;
    if (!pods.some((p) => p.ns === nsOf(pdb) && selects(sel, p.labels))) {
      err(pdb, 'spec.selector', "matches no workload's pods");
    }
  }
  for (const np of docs.filter((d) => d.kind === 'NetworkPolicy')) {
    const spec = np.spec || {};
    if (!pods.some((p) => p.ns === nsOf(np) && selects(spec.podSelector, p.labels))) {
      err(np, 'spec.podSelector', "matches no workload's pods");
    }
    for (const [i, rule] of (spec.ingress || []).entries()) {
      for (const [j, peer] of (rule.from || []).entries()) {
        if (!peer.podSelector || peer.namespaceSelector) continue;
        if (!pods.some((p) => p.ns === nsOf(np) && selects(peer.podSelector, p.labels))) {
          err(np, `spec.ingress[${i}].from[${j}].podSelector`, "matches no workload's pods");
        }
      }
    }
  }

  for (const p of pods) podErrors(p, docs, (where, what) => err(p.doc, where, what));
  return errors;
}

// What one pod template refers to: volumes, mounts, env sources, probe ports, $(VAR)s, files in
// mounted ConfigMaps and Secrets; and the house rules.
function podErrors(p, docs, err) {
  const at = (rest) => (p.where ? `${p.where}.${rest}` : rest);
  const spec = p.spec;
  const volumes = new Map();
  for (const [i, v] of (spec.volumes || []).entries()) {
    if (volumes.has(v.name)) err(at(`spec.volumes[${i}]`), `volume '${v.name}' defined twice`);
    volumes.set(v.name, v);
    const refs = [];
    if (v.configMap)
      refs.push(['ConfigMap', v.configMap.name, v.configMap.items, v.configMap.optional]);
    if (v.secret) refs.push(['Secret', v.secret.secretName, v.secret.items, v.secret.optional]);
    for (const s of (v.projected && v.projected.sources) || []) {
      if (s.configMap)
        refs.push(['ConfigMap', s.configMap.name, s.configMap.items, s.configMap.optional]);
      if (s.secret) refs.push(['Secret', s.secret.name, s.secret.items, s.secret.optional]);
    }
    for (const [kind, name, items, optional] of refs) {
      const ref = find(docs, kind, p.ns, name);
      if (!ref) {
        if (!optional) err(at(`spec.volumes[${v.name}]`), `${kind} '${name}' is not in the render`);
        continue;
      }
      for (const item of items || []) {
        if (!keysOf(ref).has(item.key)) {
          err(at(`spec.volumes[${v.name}]`), `${kind} '${name}' has no key '${item.key}'`);
        }
      }
    }
    if (
      v.persistentVolumeClaim &&
      !find(docs, 'PersistentVolumeClaim', p.ns, v.persistentVolumeClaim.claimName)
    ) {
      err(
        at(`spec.volumes[${v.name}]`),
        `PersistentVolumeClaim '${v.persistentVolumeClaim.claimName}' is not in the render`,
      );
    }
  }

  // Prometheus scrapes the port the annotations name: a port the pod declares.
  if (p.annotations['prometheus.io/scrape'] === 'true') {
    const port = Number(p.annotations['prometheus.io/port']);
    const declared = (spec.containers || []).some((c) =>
      (c.ports || []).some((cp) => cp.containerPort === port),
    );
    if (!declared) {
      err(
        at('metadata.annotations'),
        `prometheus.io/port '${p.annotations['prometheus.io/port']}' is not a declared ` +
          'container port',
      );
    }
  }

  const all = [
    ...(spec.initContainers || []).map((c) => ['initContainers', c]),
    ...(spec.containers || []).map((c) => ['containers', c]),
  ];
  for (const [list, c] of all) {
    const where = at(`spec.${list}[${c.name}]`);
    const ports = c.ports || [];
    const names = ports.map((cp) => cp.name).filter(Boolean);
    if (new Set(names).size !== names.length) err(where, 'a port name repeats');

    // Mounts name volumes of the pod (or the StatefulSet's claim templates).
    for (const m of c.volumeMounts || []) {
      if (!volumes.has(m.name) && !p.claims.includes(m.name)) {
        err(`${where}.volumeMounts[${m.name}]`, `no volume named '${m.name}'`);
      }
    }

    // Environment from ConfigMaps and Secrets that exist, with the keys named.
    const envNames = new Set();
    for (const e of c.env || []) {
      envNames.add(e.name);
      const from = e.valueFrom || {};
      for (const [kind, ref] of [
        ['ConfigMap', from.configMapKeyRef],
        ['Secret', from.secretKeyRef],
      ]) {
        if (!ref) continue;
        const doc = find(docs, kind, p.ns, ref.name);
        if (!doc) {
          if (!ref.optional)
            err(`${where}.env[${e.name}]`, `${kind} '${ref.name}' is not in the render`);
        } else if (!keysOf(doc).has(ref.key)) {
          if (!ref.optional)
            err(`${where}.env[${e.name}]`, `${kind} '${ref.name}' has no key '${ref.key}'`);
        }
      }
    }
    for (const e of c.envFrom || []) {
      for (const [kind, ref] of [
        ['ConfigMap', e.configMapRef],
        ['Secret', e.secretRef],
      ]) {
        if (!ref) continue;
        const doc = find(docs, kind, p.ns, ref.name);
        if (!doc) {
          if (!ref.optional) err(`${where}.envFrom`, `${kind} '${ref.name}' is not in the render`);
          continue;
        }
        for (const k of keysOf(doc)) envNames.add((e.prefix || '') + k);
      }
    }

    // $(VAR) in command and args: the kubelet expands only variables the container has, and
    // leaves any other reference as it is, so a typo reaches the program as text.
    for (const field of ['command', 'args']) {
      for (const [i, arg] of (c[field] || []).entries()) {
        for (const m of String(arg).matchAll(/\$\$|\$\(([^)]*)\)/g)) {
          if (m[0] === '$$') continue;
          if (!envNames.has(m[1])) {
            err(`${where}.${field}[${i}]`, `$(${m[1]}) is not a variable of the container`);
          }
        }
      }
    }

    // A `sh -c SCRIPT` reads its variables from the same environment: $NAME and ${NAME} there
    // must be the container's too (an unset one is an empty string, silently).
    const argv = [...(c.command || []), ...(c.args || [])].map(String);
    const shell = argv.findIndex(
      (a, i) => /^(\/usr)?(\/bin\/)?(ba|da)?sh$/.test(a) && argv[i + 1] === '-c',
    );
    if (shell >= 0 && argv[shell + 2] !== undefined) {
      for (const m of argv[shell + 2].matchAll(
        /\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))/g,
      )) {
        const name = m[1] || m[2];
        if (!envNames.has(name))
          err(`${where}`, `the shell script reads $${name}, not a variable of the container`);
      }
    }

    // A path in the flags that lies in a mounted ConfigMap or Secret is one of its keys.
    for (const field of ['command', 'args']) {
      for (const [i, arg] of (c[field] || []).entries()) {
        const m = String(arg).match(/(?:^|=)(\/[^\s=]+)$/);
        if (!m) continue;
        for (const mount of c.volumeMounts || []) {
          const v = volumes.get(mount.name);
          if (!v || mount.subPath || !(v.configMap || v.secret)) continue;
          const dir = mount.mountPath.replace(/\/+$/, '') + '/';
          if (!m[1].startsWith(dir)) continue;
          const file = m[1].slice(dir.length);
          const src = v.configMap || v.secret;
          const kind = v.configMap ? 'ConfigMap' : 'Secret';
          const name = v.configMap ? v.configMap.name : v.secret.secretName;
          const doc = find(docs, kind, p.ns, name);
          if (!doc) continue; // reported with the volume
          const files = src.items ? src.items.map((it) => it.path) : [...keysOf(doc)];
          if (!files.includes(file)) {
            err(
              `${where}.${field}[${i}]`,
              `${m[1]}: ${kind} '${name}' mounted at ${mount.mountPath} has no file '${file}'`,
            );
          }
        }
      }
    }

    // Probes check ports the container declares.
    for (const probe of ['startupProbe', 'readinessProbe', 'livenessProbe']) {
      const pr = c[probe];
      if (!pr) continue;
      const action = pr.httpGet || pr.tcpSocket || pr.grpc;
      if (!action) continue;
      const port = action.port;
      const ok =
        typeof port === 'string'
          ? ports.some((cp) => cp.name === port)
          : ports.some((cp) => cp.containerPort === port);
      if (!ok) err(`${where}.${probe}`, `port ${port} is not a declared port of the container`);
    }

    // House rules (docs/deploy.md, "Kubernetes"): every container runs as a non-root user on a
    // read-only root file system, without privilege escalation, and says what it needs.
    const sc = c.securityContext || {};
    if (!podRunsAsNonRoot(spec, c)) err(`${where}.securityContext`, 'runAsNonRoot is not true');
    if (sc.readOnlyRootFilesystem !== true)
      err(`${where}.securityContext`, 'readOnlyRootFilesystem is not true');
    if (sc.allowPrivilegeEscalation !== false)
      err(`${where}.securityContext`, 'allowPrivilegeEscalation is not false');
    for (const kind of ['requests', 'limits']) {
      for (const r of ['cpu', 'memory']) {
        if (!(c.resources && c.resources[kind] && c.resources[kind][r] !== undefined)) {
          err(`${where}.resources`, `no ${kind}.${r}`);
        }
      }
    }
  }
}

function podRunsAsNonRoot(spec, container) {
  const c = (container && container.securityContext) || {};
  if (c.runAsNonRoot !== undefined) return c.runAsNonRoot === true;
  return !!(spec.securityContext && spec.securityContext.runAsNonRoot === true);
}

// ---- Strata's own configuration -----------------------------------------------------------------

// JSON with // and /* */ comments (what membership/cluster_file.cc accepts) as plain JSON.
function stripJsonComments(text) {
  let out = '';
  for (let i = 0; i < text.length; i++) {
    const ch = text[i];
    if (ch === '"') {
      const start = i;
      for (i++; i < text.length && text[i] !== '"'; i++) if (text[i] === '\\') i++;
      out += text.slice(start, i + 1);
    } else if (ch === '/' && text[i + 1] === '/') {
      while (i < text.length && text[i] !== '\n') i++;
      out += '\n';
    } else if (ch === '/' && text[i + 1] === '*') {
      const end = text.indexOf('*/', i + 2);
      i = end < 0 ? text.length : end + 1;
    } else {
      out += ch;
    }
  }
  return out;
}

// `host:port` names a Service of the render (its first DNS label, in `ns` unless the name says
// another) with that port.
function serviceAddressError(docs, ns, address) {
  const m = /^([a-z0-9-]+)(?:\.([a-z0-9-]+))?[a-z0-9.-]*:([0-9]+)$/.exec(address || '');
  if (!m) return `'${address}' is not host:port`;
  const svc = find(docs, 'Service', m[2] || ns, m[1]);
  if (!svc) return `'${address}': no Service '${m[1]}' in the render`;
  if (!((svc.spec && svc.spec.ports) || []).some((sp) => sp.port === Number(m[3]))) {
    return `'${address}': Service '${m[1]}' has no port ${m[3]}`;
  }
  return null;
}

// One Redis Cluster node of STRATA_SHARED_TIER (the value of --shared_tier). A host that names a
// StatefulSet's pod of the render, <statefulset>-<ordinal>.<service>[.<namespace>...], must be
// one of its pods, under its headless Service, on a port that Service serves; a host whose
// second label is a Service of the render is held to that too; a host that names a Service of
// the render (<service>[.<namespace>...]), to that Service and port. Any other host is outside
// the render (a Redis Cluster run elsewhere) and left alone.
function sharedTierAddressError(docs, ns, address) {
  const m = /^([a-z0-9.-]+):([0-9]+)$/.exec(address);
  if (!m) return `'${address}' is not host:port`;
  const labels = m[1].split('.');
  const pod = /^([a-z0-9-]+)-([0-9]+)$/.exec(labels[0]);
  const podNs = labels[2] || ns;
  const sts = pod && find(docs, 'StatefulSet', podNs, pod[1]);
  if (!sts && !(labels.length > 1 && find(docs, 'Service', podNs, labels[1]))) {
    return find(docs, 'Service', labels[1] || ns, labels[0])
      ? serviceAddressError(docs, ns, address)
      : null;
  }
  if (!sts) {
    return (
      `'${address}': no StatefulSet '${pod ? pod[1] : labels[0]}' in the render has pods ` +
      `under Service '${labels[1]}'`
    );
  }
  const spec = sts.spec || {};
  const replicas = spec.replicas === undefined ? 1 : spec.replicas;
  if (Number(pod[2]) >= replicas) {
    return (
      `'${address}': StatefulSet '${pod[1]}' has ${replicas} pods ` +
      `(${pod[1]}-0 to ${pod[1]}-${replicas - 1})`
    );
  }
  if (labels[1] !== spec.serviceName) {
    return (
      `'${address}': the pods of StatefulSet '${pod[1]}' are named under Service ` +
      `'${spec.serviceName}', not '${labels[1] || ''}'`
    );
  }
  const svc = find(docs, 'Service', podNs, spec.serviceName);
  if (svc && !((svc.spec && svc.spec.ports) || []).some((sp) => sp.port === Number(m[2]))) {
    return `'${address}': Service '${spec.serviceName}' has no port ${m[2]}`;
  }
  return null;
}

// The environment a container's $(VAR)s expand from, as far as the render says: envFrom's
// ConfigMaps in order (a later one wins), then env's values and ConfigMap keys (env wins).
function containerEnv(docs, ns, c) {
  const env = new Map();
  for (const e of c.envFrom || []) {
    const doc = e.configMapRef && find(docs, 'ConfigMap', ns, e.configMapRef.name);
    if (!doc) continue;
    for (const k of keysOf(doc)) env.set((e.prefix || '') + k, valueOf(doc, k));
  }
  for (const e of c.env || []) {
    const ref = e.valueFrom && e.valueFrom.configMapKeyRef;
    const doc = ref && find(docs, 'ConfigMap', ns, ref.name);
    if (e.value !== undefined) env.set(e.name, String(e.value));
    else if (doc) env.set(e.name, valueOf(doc, ref.key));
    else env.delete(e.name); // from a Secret or the pod: unknown here
  }
  return env;
}

// The pods of the render that a shared tier node (host:port) names, as {doc, labels, spec, ns,
// port}: a StatefulSet's pod (<statefulset>-<ordinal>.<service>...), on that port, or the pods
// a Service (<service>[.<namespace>...]) selects, on the port's target. [] for a node outside
// the render (sharedTierAddressError reports the ones that look inside it but are not).
function sharedTierTargets(docs, ns, address) {
  const m = /^([a-z0-9.-]+):([0-9]+)$/.exec(address);
  if (!m) return [];
  const labels = m[1].split('.');
  const pod = /^([a-z0-9-]+)-([0-9]+)$/.exec(labels[0]);
  const pods = podTemplates(docs);
  const sts = pod && find(docs, 'StatefulSet', labels[2] || ns, pod[1]);
  if (sts) {
    return pods.filter((p) => p.doc === sts).map((p) => ({ ...p, port: Number(m[2]) }));
  }
  const svc = find(docs, 'Service', labels[1] || ns, labels[0]);
  const sp = svc && ((svc.spec && svc.spec.ports) || []).find((x) => x.port === Number(m[2]));
  if (!sp || !svc.spec.selector) return [];
  const target = sp.targetPort === undefined ? sp.port : sp.targetPort;
  const out = [];
  const selected = pods.filter(
    (q) => q.ns === nsOf(svc) && selectsMap(svc.spec.selector, q.labels),
  );
  for (const p of selected) {
    let port = target;
    if (typeof target === 'string') {
      const cp = (p.spec.containers || [])
        .flatMap((c) => c.ports || [])
        .find((x) => x.name === target);
      if (!cp) continue; // reported with the Service
      port = cp.containerPort;
    }
    out.push({ ...p, port });
  }
  return out;
}

// Whether a NetworkPolicy rule's ports (a list; none: every port) take TCP `port` of `pod`.
function policyPortsAllow(rulePorts, pod, port) {
  if (!rulePorts || rulePorts.length === 0) return true;
  return rulePorts.some((rp) => {
    if ((rp.protocol || 'TCP') !== 'TCP') return false;
    if (rp.port === undefined) return true;
    if (typeof rp.port === 'string') {
      return (pod.spec.containers || []).some((c) =>
        (c.ports || []).some((cp) => cp.name === rp.port && cp.containerPort === port),
      );
    }
    return rp.endPort ? port >= rp.port && port <= rp.endPort : rp.port === port;
  });
}

// Whether one of a rule's peers (from or to; none: everyone) is `pod`. A namespaceSelector or an
// ipBlock is taken as letting it through: the render does not say which namespaces or addresses
// they match.
function policyPeersAllow(peers, policy, pod) {
  if (!peers || peers.length === 0) return true;
  return peers.some((peer) => {
    if (peer.ipBlock || peer.namespaceSelector) {
      return !peer.podSelector || selects(peer.podSelector, pod.labels);
    }
    return nsOf(policy) === pod.ns && selects(peer.podSelector, pod.labels);
  });
}

// The NetworkPolicies that isolate `pod` for `type` (Ingress or Egress), and whether any of them
// lets `peer` through on `port` of `portPod` (the pod that listens).
function policyVerdict(docs, pod, type, peer, portPod, port) {
  const field = type === 'Ingress' ? 'ingress' : 'egress';
  const isolating = docs.filter((np) => {
    if (np.kind !== 'NetworkPolicy' || nsOf(np) !== pod.ns) return false;
    const spec = np.spec || {};
    const types = spec.policyTypes || (spec.egress ? ['Ingress', 'Egress'] : ['Ingress']);
    return types.includes(type) && selects(spec.podSelector, pod.labels);
  });
  const allowed = isolating.some((np) =>
    ((np.spec || {})[field] || []).some(
      (rule) =>
        policyPeersAllow(type === 'Ingress' ? rule.from : rule.to, np, peer) &&
        policyPortsAllow(rule.ports, portPod, port),
    ),
  );
  return { isolating: isolating.map(nameOf), allowed: isolating.length === 0 || allowed };
}

// A process given the shared tier (--shared_tier: the store, the router, the prefill and decode
// nodes) must reach its nodes: where they are pods of the render, the NetworkPolicies must let it
// out (Egress) and let it in to them (Ingress) on their port. Redis behind a policy that forgets
// one of them is no error the process stops on: the store serves without the tier, the router
// routes without it, a node whose store is lost recomputes.
function sharedTierPolicyErrors(docs) {
  const errors = [];
  for (const p of podTemplates(docs)) {
    for (const c of p.spec.containers || []) {
      const args = (c.args || []).map(String);
      const i = args.findIndex((a) => /^--?shared_tier(=|$)/.test(a));
      if (i < 0) continue;
      const env = containerEnv(docs, p.ns, c);
      const flag = args[i].includes('=') ? args[i].slice(args[i].indexOf('=') + 1) : args[i + 1];
      const value = String(flag || '').replace(/\$\(([^)]*)\)/g, (all, name) =>
        env.has(name) ? env.get(name) : all,
      );
      if (value.includes('$(')) continue; // reported by the $(VAR) check
      const where =
        `${idOf(p.doc)}: ${p.where ? p.where + '.' : ''}` +
        `spec.containers[${c.name}].args[${i}]`;
      const seen = new Set();
      for (const address of value.split(',').map((a) => a.trim()).filter(Boolean)) {
        for (const t of sharedTierTargets(docs, p.ns, address)) {
          const key = `${idOf(t.doc)}:${t.port}`;
          if (seen.has(key)) continue;
          seen.add(key);
          const to = `${idOf(t.doc)}'s pods on port ${t.port}`;
          const egress = policyVerdict(docs, p, 'Egress', t, t, t.port);
          if (!egress.allowed) {
            errors.push(
              `${where}: --shared_tier: no NetworkPolicy lets this pod out to ${to} ` +
                `(its egress is isolated by NetworkPolicy ${egress.isolating.join(', ')})`,
            );
          }
          const ingress = policyVerdict(docs, t, 'Ingress', p, t, t.port);
          if (!ingress.allowed) {
            errors.push(
              `${where}: --shared_tier: no NetworkPolicy lets this pod in to ${to} ` +
                `(their ingress is isolated by NetworkPolicy ${ingress.isolating.join(', ')})`,
            );
          }
        }
      }
    }
  }
  return errors;
}

// The cluster file (a ConfigMap key cluster.json) and the shared settings (STRATA_ETCD) name
// Services that the render has, on ports they serve; the shared tier's nodes (STRATA_SHARED_TIER)
// are pods or Services of the render, or outside it.
function strataErrors(docs) {
  const errors = [];
  for (const cm of docs.filter((d) => d.kind === 'ConfigMap')) {
    const where = `${idOf(cm)}: data`;
    const text = valueOf(cm, 'cluster.json');
    if (text !== null) {
      let spec;
      try {
        spec = JSON.parse(stripJsonComments(text));
      } catch (e) {
        errors.push(`${where}.cluster.json: not JSON (comments aside): ${e.message}`);
        continue;
      }
      if (spec.store) {
        const e = serviceAddressError(docs, nsOf(cm), spec.store);
        if (e) errors.push(`${where}.cluster.json: store: ${e}`);
      }
      if (typeof spec.model !== 'string' || !spec.model.startsWith('/')) {
        errors.push(
          `${where}.cluster.json: model: '${spec.model}' is not an absolute path (the ` +
            'file is read from a mounted folder: a relative path would resolve there)',
        );
      }
      for (const role of ['prefill', 'decode']) {
        if (!(spec.nodes || []).some((n) => n.role === role)) {
          errors.push(
            `${where}.cluster.json: nodes: no ${role} node (the file needs one per role)`,
          );
        }
      }
    }
    const etcd = valueOf(cm, 'STRATA_ETCD');
    if (etcd !== null) {
      const e = serviceAddressError(docs, nsOf(cm), etcd);
      if (e) errors.push(`${where}.STRATA_ETCD: ${e}`);
    }
    const shared = valueOf(cm, 'STRATA_SHARED_TIER');
    for (const address of (shared || '').split(',').filter(Boolean)) {
      const e = sharedTierAddressError(docs, nsOf(cm), address.trim());
      if (e) errors.push(`${where}.STRATA_SHARED_TIER: ${e}`);
    }
  }
  return errors;
}

// ---- one rendered file --------------------------------------------------------------------------

// {docs, errors} of a multi-document YAML text.
function check(text) {
  const errors = [];
  const docs = [];
  for (const [i, d] of YAML.parseAllDocuments(text).entries()) {
    if (d.errors.length > 0) {
      errors.push(`document ${i + 1}: YAML: ${d.errors[0].message}`);
      continue;
    }
    const doc = d.toJS();
    if (doc === null || doc === undefined) continue;
    if (typeof doc !== 'object' || Array.isArray(doc)) {
      errors.push(`document ${i + 1}: not an object`);
      continue;
    }
    docs.push(doc);
    for (const e of schemaErrors(doc)) errors.push(`${idOf(doc)}: ${e}`);
  }
  if (docs.length === 0) errors.push('no documents');
  // The cross-checks read documents the schema may have refused: an exception there is one more
  // error, never a pass.
  for (const checks of [crossReferenceErrors, strataErrors, sharedTierPolicyErrors]) {
    try {
      errors.push(...checks(docs));
    } catch (e) {
      errors.push(`${checks.name}: could not check (${e.message}): the documents are malformed`);
    }
  }
  return { docs, errors };
}

function summary(docs) {
  const counts = {};
  for (const d of docs) counts[d.kind] = (counts[d.kind] || 0) + 1;
  return Object.keys(counts)
    .sort()
    .map((k) => `${k} ${counts[k]}`)
    .join(', ');
}

// ---- kustomization syntax -----------------------------------------------------------------------

// What kustomize v2.0.3's kustomization.yaml has (sigs.k8s.io/kustomize v2.0.3, pkg/types).
const kV2Fields = new Set([
  'apiVersion',
  'kind',
  'namePrefix',
  'nameSuffix',
  'namespace',
  'commonLabels',
  'commonAnnotations',
  'patchesStrategicMerge',
  'patchesJson6902',
  'configMapGenerator',
  'secretGenerator',
  'generatorOptions',
  'vars',
  'images',
  'crds',
  'resources',
  'bases',
]);
const kV2GeneratorFields = new Set([
  'name',
  'namespace',
  'behavior',
  'files',
  'literals',
  'env',
  'type',
]);

function kustomizationErrors(dir) {
  const file = path.join(dir, 'kustomization.yaml');
  const errors = [];
  let k;
  try {
    k = YAML.parse(fs.readFileSync(file, 'utf8')) || {};
  } catch (e) {
    return [`${file}: ${e.message}`];
  }
  for (const key of Object.keys(k)) {
    if (!kV2Fields.has(key)) errors.push(`${file}: '${key}' is not a field kustomize v2.0.3 knows`);
  }
  for (const r of k.resources || []) {
    let isDir = false;
    try {
      isDir = fs.statSync(path.join(dir, r)).isDirectory();
    } catch (e) {
      /* kustomize says */
    }
    if (isDir)
      errors.push(
        `${file}: resources: '${r}' is a folder: kustomize v2.0.3 takes folders under bases:`,
      );
  }
  for (const field of ['configMapGenerator', 'secretGenerator']) {
    for (const g of k[field] || []) {
      for (const key of Object.keys(g)) {
        if (!kV2GeneratorFields.has(key))
          errors.push(`${file}: ${field}: '${key}' is not known to kustomize v2.0.3`);
      }
    }
  }
  return errors;
}

// ---- main ---------------------------------------------------------------------------------------

function printErrors(errors) {
  for (const e of errors) console.log(`    ${e}`);
}

function main(argv) {
  if (argv[0] === '--kustomization' && argv.length === 2) {
    const errors = kustomizationErrors(argv[1]);
    console.log(
      `${errors.length ? 'FAIL' : 'ok  '} ${argv[1]}/kustomization.yaml: ` +
        (errors.length ? `${errors.length} errors` : 'kustomize v2.0.3 syntax'),
    );
    printErrors(errors);
    return errors.length ? 1 : 0;
  }
  if (argv[0] === '--expect-reject' && argv.length >= 2) {
    let failed = 0;
    for (const file of argv.slice(1)) {
      // A folder is a kustomization to refuse; a file, rendered documents.
      const isDir = fs.statSync(file).isDirectory();
      const text = fs.readFileSync(isDir ? path.join(file, 'kustomization.yaml') : file, 'utf8');
      const expected = [...text.matchAll(/^# expect: (.+)$/gm)].map((m) => m[1].trim());
      const { errors } = isDir ? { errors: kustomizationErrors(file) } : check(text);
      const missing = expected.filter((x) => !errors.some((e) => e.includes(x)));
      if (expected.length === 0) {
        console.log(`FAIL ${file}: it has no '# expect: TEXT' line`);
        failed++;
      } else if (errors.length === 0) {
        console.log(
          `FAIL ${file}: accepted, but it is broken on purpose (expected: ${expected.join('; ')})`,
        );
        failed++;
      } else if (missing.length > 0) {
        console.log(
          `FAIL ${file}: rejected, but not for the reason expected ` +
            `(${missing.join('; ')}); its errors:`,
        );
        printErrors(errors);
        failed++;
      } else {
        const first = errors.find((e) => e.includes(expected[0]));
        console.log(`ok   ${file}: rejected as expected: ${first}`);
      }
    }
    return failed ? 1 : 0;
  }
  let label = null;
  if (argv[0] === '--label') {
    label = argv[1];
    argv = argv.slice(2);
  }
  if (argv.length !== 1) {
    console.error(
      'usage: validate.js [--label NAME] RENDERED.yaml | --kustomization DIR | ' +
        '--expect-reject FILE...',
    );
    return 2;
  }
  const { docs, errors } = check(fs.readFileSync(argv[0], 'utf8'));
  label = label || argv[0];
  if (errors.length) {
    console.log(`FAIL ${label}: ${errors.length} errors in ${docs.length} documents`);
    printErrors(errors);
    return 1;
  }
  console.log(`ok   ${label}: ${docs.length} documents valid (${summary(docs)})`);
  return 0;
}

process.exitCode = main(process.argv.slice(2));
