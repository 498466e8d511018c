//! The machine id this process stamps into ids, and the layout it was
//! checked against.

use std::sync::RwLock;

use snowgate_plugin::{LayoutError, MachineId, SnowflakeLayout};

/// The process's machine id. Fixed for a single gateway; a fleet lease can
/// withdraw it (then plugins refuse to make ids) and grant a new one.
#[derive(Debug)]
pub struct MachineIdentity {
    layout: SnowflakeLayout,
    current: RwLock<Result<u32, String>>,
}

impl MachineIdentity {
    /// A fixed machine id, refused when out of range for `layout`.
    pub fn fixed(layout: SnowflakeLayout, machine_id: u32) -> Result<MachineIdentity, LayoutError> {
        layout.check_machine_id(machine_id)?;
        Ok(MachineIdentity {
            layout,
            current: RwLock::new(Ok(machine_id)),
        })
    }

    /// An identity that holds no machine id yet, for `reason`.
    pub fn unassigned(layout: SnowflakeLayout, reason: impl Into<String>) -> MachineIdentity {
        MachineIdentity {
            layout,
            current: RwLock::new(Err(reason.into())),
        }
    }

    /// The layout machine ids are checked against.
    pub fn layout(&self) -> SnowflakeLayout {
        self.layout
    }

    /// The machine id to use now, or why there is none.
    pub fn current(&self) -> Result<MachineId, String> {
        let current = self
            .current
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match &*current {
            Ok(value) => Ok(MachineId {
                value: *value,
                layout: self.layout,
            }),
            Err(reason) => Err(reason.clone()),
        }
    }

    /// Grants a machine id, refused when out of range for the layout.
    pub fn assign(&self, machine_id: u32) -> Result<(), LayoutError> {
        self.layout.check_machine_id(machine_id)?;
        *self
            .current
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Ok(machine_id);
        Ok(())
    }

    /// Withdraws the machine id: until the next `assign`, no ids are made.
    pub fn withdraw(&self, reason: impl Into<String>) {
        *self
            .current
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Err(reason.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_an_out_of_range_machine_id() {
        let err = MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 1023).unwrap_err();
        assert!(err.to_string().contains("0..=1022"), "{err}");
        assert!(MachineIdentity::fixed(SnowflakeLayout::TrtllmV2, 16383).is_ok());
    }

    #[test]
    fn withdrawn_identity_reports_the_reason_until_reassigned() {
        let identity = MachineIdentity::fixed(SnowflakeLayout::TrtllmV2, 5).expect("in range");
        identity.withdraw("lease lost");
        assert_eq!(identity.current(), Err("lease lost".to_string()));
        identity.assign(9).expect("in range");
        assert_eq!(
            identity.current(),
            Ok(MachineId {
                value: 9,
                layout: SnowflakeLayout::TrtllmV2
            })
        );
    }
}
