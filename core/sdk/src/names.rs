//! Closed sets of names, as stage parameters spell them.

/// An enum whose variants are the names a stage parameter takes: serde in those spellings,
/// `NAMES` for the manifest's `ParamType::one_of` (so the manifest and the code cannot disagree),
/// `ALL`, `as_str`, `from_name`, `param_type` (a subset's manifest type) and `Display`. A misspelt name never reaches the plugin: the pipeline checker refuses
/// it against `NAMES` first, and serde would refuse it next. Needs only this crate, under its
/// own name (`attnbench_sdk`).
///
/// ```
/// attnbench_sdk::named_enum! {
///     /// How the check runs.
///     pub enum Check { Full = "full", Sampled = "sampled" }
/// }
/// assert_eq!(Check::NAMES, ["full", "sampled"]);
/// assert_eq!(Check::Sampled.to_string(), "sampled");
/// assert_eq!(Check::from_name("full"), Some(Check::Full));
/// assert_eq!(Check::ALL.len(), 2);
/// assert_eq!(Check::param_type(&[Check::Full]), attnbench_sdk::ParamType::Enum(vec!["full".into()]));
/// ```
#[macro_export]
macro_rules! named_enum {
    ($(#[$meta:meta])* $vis:vis enum $name:ident {
        $($(#[$variant_meta:meta])* $variant:ident = $text:literal),+ $(,)?
    }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, $crate::serde::Serialize, $crate::serde::Deserialize)]
        #[serde(crate = "attnbench_sdk::serde")]
        $vis enum $name {
            $($(#[$variant_meta])* #[serde(rename = $text)] $variant),+
        }

        impl $name {
            /// Every name, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($text),+];
            /// Every variant, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }

            /// The variant a name spells (as a record stores it), if any.
            pub fn from_name(name: &str) -> Option<$name> {
                Self::ALL.iter().copied().find(|variant| variant.as_str() == name)
            }

            /// The manifest's type of a parameter that takes only `subset` of the names.
            pub fn param_type(subset: &[$name]) -> $crate::ParamType {
                $crate::ParamType::Enum(subset.iter().map(|v| v.as_str().to_string()).collect())
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}
