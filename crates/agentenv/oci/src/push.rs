//! Push over the distribution API: blobs (monolithic POST + PUT upload), image manifests and
//! multi-platform indexes.

use crate::client::{Body, Client, RegistryOptions, header};
use crate::error::OciError;
use crate::manifest::{self, Descriptor, Index, Manifest, Platform};
use crate::reference::{Digest, ImageRef};

/// A connection to one repository for pushing (bearer scope `pull,push`).
pub struct Pusher {
    client: Client,
}

/// One layer to push: its blob and how it is encoded.
#[derive(Debug, Clone)]
pub struct LayerBlob {
    /// Layer media type (e.g. [`manifest::OCI_LAYER_GZIP`]).
    pub media_type: String,
    /// The blob as stored (compressed).
    pub bytes: Vec<u8>,
}

impl Pusher {
    /// Pushes to `image`'s registry and repository (its tag or digest is not used here).
    pub fn new(image: &ImageRef, opts: &RegistryOptions) -> Pusher {
        Pusher {
            client: Client::new(image, opts, "pull,push"),
        }
    }

    /// Whether the repository already has the blob.
    pub fn has_blob(&self, digest: &Digest) -> Result<bool, OciError> {
        let url = self.client.url(&format!("blobs/{digest}"));
        let resp = self
            .client
            .send("HEAD", &url, &[], Body::Empty, self.client.opts().timeout)?;
        match resp.status().as_u16() {
            200 => Ok(true),
            404 => Ok(false),
            _ => Err(self
                .client
                .status_error("HEAD", &url, "blob", digest.as_str(), resp)),
        }
    }

    /// Uploads `bytes` unless the blob is there already; returns its descriptor.
    pub fn push_blob(&self, media_type: &str, bytes: &[u8]) -> Result<Descriptor, OciError> {
        let digest = Digest::of(bytes);
        let desc = Descriptor {
            media_type: media_type.into(),
            digest: digest.clone(),
            size: bytes.len() as u64,
            platform: None,
            annotations: Default::default(),
        };
        if self.has_blob(&digest)? {
            return Ok(desc);
        }
        let c = &self.client;
        let url = c.url("blobs/uploads/");
        let resp = c.send("POST", &url, &[], Body::Empty, c.opts().timeout)?;
        if resp.status() != 202 {
            return Err(c.status_error("POST", &url, "upload", "", resp));
        }
        let location = header(&resp, "location").ok_or_else(|| OciError::Status {
            method: "POST",
            url: url.clone(),
            status: 202,
            detail: "upload session without a Location header".into(),
        })?;
        let mut put = c.resolve(&location);
        put.push(if put.contains('?') { '&' } else { '?' });
        put.push_str(&format!("digest={}", digest.as_str().replace(':', "%3A")));
        let deadline = c.opts().blob_deadline(bytes.len() as u64);
        let resp = c.send(
            "PUT",
            &put,
            &[],
            Body::Bytes(bytes, "application/octet-stream"),
            deadline,
        )?;
        if resp.status() != 201 {
            return Err(c.status_error("PUT", &put, "blob", digest.as_str(), resp));
        }
        Ok(desc)
    }

    /// PUTs a manifest or index document under `reference` (a tag or its digest); returns its digest.
    pub fn push_manifest(
        &self,
        reference: &str,
        media_type: &str,
        bytes: &[u8],
    ) -> Result<Digest, OciError> {
        let c = &self.client;
        let url = c.url(&format!("manifests/{reference}"));
        let resp = c.send(
            "PUT",
            &url,
            &[],
            Body::Bytes(bytes, media_type),
            c.opts().timeout,
        )?;
        if resp.status() != 201 {
            return Err(c.status_error("PUT", &url, "manifest", reference, resp));
        }
        Ok(Digest::of(bytes))
    }

    /// Pushes layers, config and an OCI image manifest, tagged `reference`; returns the manifest's
    /// descriptor (digest, size).
    pub fn push_image(
        &self,
        reference: &str,
        config: &[u8],
        layers: &[LayerBlob],
    ) -> Result<Descriptor, OciError> {
        self.push_image_as(
            reference,
            manifest::OCI_MANIFEST,
            manifest::OCI_CONFIG,
            config,
            layers,
        )
    }

    /// Like [`Pusher::push_image`] as a Docker v2 schema 2 manifest (layers must be Docker gzip layers).
    pub fn push_docker_image(
        &self,
        reference: &str,
        config: &[u8],
        layers: &[LayerBlob],
    ) -> Result<Descriptor, OciError> {
        self.push_image_as(
            reference,
            manifest::DOCKER_MANIFEST,
            manifest::DOCKER_CONFIG,
            config,
            layers,
        )
    }

    fn push_image_as(
        &self,
        reference: &str,
        manifest_type: &str,
        config_type: &str,
        config: &[u8],
        layers: &[LayerBlob],
    ) -> Result<Descriptor, OciError> {
        let mut descs = Vec::with_capacity(layers.len());
        for l in layers {
            descs.push(self.push_blob(&l.media_type, &l.bytes)?);
        }
        let config = self.push_blob(config_type, config)?;
        let m = Manifest {
            schema_version: 2,
            media_type: Some(manifest_type.into()),
            config,
            layers: descs,
            annotations: Default::default(),
        };
        let body = serde_json::to_vec(&m).map_err(|e| OciError::BadDocument {
            what: "manifest",
            reference: reference.into(),
            reason: e.to_string(),
        })?;
        let digest = self.push_manifest(reference, manifest_type, &body)?;
        Ok(Descriptor {
            media_type: manifest_type.into(),
            digest,
            size: body.len() as u64,
            platform: None,
            annotations: Default::default(),
        })
    }

    /// Pushes an OCI index of already pushed manifests, one per platform, tagged `reference`.
    pub fn push_index(
        &self,
        reference: &str,
        manifests: &[(Platform, Descriptor)],
    ) -> Result<Digest, OciError> {
        self.push_list(reference, manifest::OCI_INDEX, manifests)
    }

    /// Pushes a Docker manifest list (the pre-OCI index) of already pushed Docker manifests.
    pub fn push_docker_list(
        &self,
        reference: &str,
        manifests: &[(Platform, Descriptor)],
    ) -> Result<Digest, OciError> {
        self.push_list(reference, manifest::DOCKER_LIST, manifests)
    }

    fn push_list(
        &self,
        reference: &str,
        media_type: &str,
        manifests: &[(Platform, Descriptor)],
    ) -> Result<Digest, OciError> {
        let index = Index {
            schema_version: 2,
            media_type: Some(media_type.into()),
            manifests: manifests
                .iter()
                .map(|(p, d)| Descriptor {
                    platform: Some(p.clone()),
                    ..d.clone()
                })
                .collect(),
            annotations: Default::default(),
        };
        let body = serde_json::to_vec(&index).map_err(|e| OciError::BadDocument {
            what: "index",
            reference: reference.into(),
            reason: e.to_string(),
        })?;
        self.push_manifest(reference, media_type, &body)
    }
}
