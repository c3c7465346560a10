//! moonep (under construction by its owner).
