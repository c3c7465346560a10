//! flashkda (under construction by its owner).
